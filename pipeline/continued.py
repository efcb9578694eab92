"""Steps that add up across rounds that keep their start (`train.continue_kept`).

A round whose trained states all stay inside the gate's margin exports its start unchanged
(`kept_start`), and without this the next round trains from that same start again: a fine-tune
that dips before it climbs (the base climb at lr 3e-4 on one GPU: -0.22 in the gate's simulation
for ~300 steps, ~1,000 steps to come back) then never gets past the dip when rounds are short.
With it, a round that keeps its start also writes its last trained state beside the export
(`<out>/last/`, fp32: it is a training init, never served), and the next round trains from
those weights while its gate, its step-0 evaluation, its kept-start export and its anchor stay
on the drafter that serves. The trained-but-not-better state is never exported as a round's
drafter, benchmarked, served or promoted.

Three places use it: the loop picks the state (`continued_from`), the driver checks it against
the drafter the round is given and copies it to `<out>/init/continue/` (`copy_continued`), and
the workers write it at export (`write_last`) and load it after the step-0 evaluation
(`load_continued`). docs/training.md, "Rounds that keep their start"."""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path
from typing import Any

import torch

LAST = "last"  # <out>/last/: the last trained state of a round that kept its start
CONTINUE = "continue"  # <out>/init/continue/: the state this round trains from, when not its start


def continued_from(enabled: bool, previous: dict[str, Any] | None, start: str) -> str | None:
    """The previous round's last trained state when that round kept its start (its train
    record's `kept_start` and `last_dir`), the folder is still there, and the drafter it kept
    (its export: its start, byte for byte) is the one this round starts from (`start`, the
    serving drafter); else None (the round trains from `start`, as without the option)."""
    if not enabled or not previous or not previous.get("kept_start"):
        return None
    last = previous.get("last_dir")
    if not last or not (Path(last) / "model.safetensors").is_file():
        return None
    return last if same_weights(Path(previous["drafter_dir"]), Path(start)) else None


def same_weights(a: Path, b: Path) -> bool:
    """Two drafter folders hold the same weight files, byte for byte."""
    names = sorted(p.name for p in a.glob("*.safetensors"))
    return (
        bool(names)
        and names == sorted(p.name for p in b.glob("*.safetensors"))
        and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)
    )


def copy_continued(src: str | Path, given: Any, dest: Path) -> str | None:
    """Copy the state to continue from into `dest` (fp32), after checking it is the drafter
    `given` trained further: the same config (shape, aux layers) and the same d2t/t2d. Returns
    the reason it cannot be used (the round then trains from its start), or None once copied."""
    from eagle3.checkpoint import load_drafter, save_drafter

    try:
        cfg, state = load_drafter(src)
    except Exception as e:  # noqa: BLE001 - an unreadable state is a reason to start afresh
        return f"{src} does not load ({type(e).__name__}: {e})"
    gcfg, gstate = given
    shape = {k: v for k, v in cfg.as_dict().items() if k not in ("torch_dtype", "extra")}
    if shape != {k: v for k, v in gcfg.as_dict().items() if k not in ("torch_dtype", "extra")}:
        return f"{src} has another drafter config than the drafter given"
    if not all(state[k].equal(gstate[k]) for k in ("d2t", "t2d") if k in gstate):
        return f"{src} has another draft vocabulary (d2t/t2d) than the drafter given"
    save_drafter(state, cfg, dest, dtype=torch.float32)
    return None


def write_last(out: Path, state: dict[str, torch.Tensor], cfg) -> str:
    """Rank 0, at export of a round that kept its start: its last trained state in fp32 (the
    master weights: the next round goes on from exactly these), written atomically."""
    from eagle3.checkpoint import save_drafter

    shutil.rmtree(out / LAST, ignore_errors=True)  # a re-export: the loop's key file is in it
    return str(save_drafter(state, cfg, out / LAST, dtype=torch.float32))


def load_continued(module: torch.nn.Module, folder: Path) -> None:
    """Every rank: load the weights of `folder` into the wrapped drafter in place (DDP, FSDP2 or
    none), so the optimizer, the anchor and the fast path keep their references. The vocab map
    is the start's (copy_continued checked they are equal)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from eagle3.checkpoint import load_drafter

    _, state = load_drafter(folder)
    weights = {f"drafter.{k}": v.float() for k, v in state.items() if v.is_floating_point()}
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(module, weights, options=opts)
