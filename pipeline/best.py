"""The train stage's choice of the state it exports, and its gate: the best state by held-out
simulated acceptance, where the drafter a round was given (step 0) is replaced only by a trained
state whose paired gain over it clears `train.gate_z` standard errors (docs/training.md, "The
gate"). Used by the workers (pipeline/train_worker.py); every rank decides alike from the
all-reduced eval sums."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.files import atomic_write, replaced_dir


def allreduce(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum `t` over the ranks (itself without a process group), back on the CPU."""
    if torch.distributed.is_initialized():
        t = t.to(device)
        torch.distributed.all_reduce(t)
    return t.cpu()


@dataclass(frozen=True)
class Gain:
    """A trained state against the start on the same eval batches: the mean over batches of the
    paired difference in simulated acceptance, and that mean's standard error."""

    mean: float
    se: float  # inf with fewer than 2 batches: no spread to measure the noise by
    n: int  # eval batches

    def clears(self, z: float) -> bool:
        """Above 0 by `z` standard errors (z = 0: any gain on average)."""
        return self.mean > 0 and (z == 0 or self.mean > z * self.se)


def paired_gain(start: list[float], now: list[float]) -> Gain:
    """The paired difference now - start over eval batches: pairing takes out what makes one
    batch easier than another for every drafter, so the margin is the noise of the difference."""
    diff = torch.tensor(now, dtype=torch.float64) - torch.tensor(start, dtype=torch.float64)
    n = len(diff)
    se = float(diff.std() / n**0.5) if n > 1 else float("inf")
    return Gain(float(diff.mean()) if n else 0.0, se, n)


class Best:
    """The drafter with the highest held-out simulated acceptance so far, kept on disk (rank 0)
    as <out>/best/ with best.json, so a resumed run still knows it. Loss keeps falling after
    acceptance peaks: the exported drafter is this one, not the last.

    The start (the drafter a round was given, offered at step 0) is replaced only by a trained
    state whose paired gain over it clears `z` standard errors (`Gain.clears`); once replaced,
    the highest aggregate score wins. best.json keeps step 0's per-batch scores for that."""

    def __init__(self, out: Path, enabled: bool, device, n_batches: int, z: float = 0.0):
        self.dir, self.meta, self.enabled, self.z = out / "best", out / "best.json", enabled, z
        rec = json.loads(self.meta.read_text()) if enabled and self.meta.exists() else {}
        # rank 0's record reaches every rank: they must agree on when `offer` saves (a collective)
        start = rec.get("start_batches") or []
        t = torch.zeros(4 + n_batches, dtype=torch.float64)
        if rec:
            t[:4] = torch.tensor([1.0, rec["step"], rec["sim_accept_len"], float(bool(start))])
            t[4 : 4 + len(start)] = torch.tensor(start, dtype=torch.float64)
        t = allreduce(t, device)
        have, step, score, has_start = t[:4].tolist()
        self.step, self.score = (int(step), score) if have else (0, float("-inf"))
        self.start: list[float] | None = t[4:].tolist() if has_start else None

    def gain(self, sims: list[float]) -> Gain | None:
        """This state's paired gain over the start (None: no start was scored)."""
        return None if self.start is None else paired_gain(self.start, sims)

    def offer(
        self, step: int, score: float, sims: list[float], gain: Gain | None, module, drafter
    ) -> bool:
        """Keep this drafter if it is the best so far; True if it is. Step 0 is the start; a
        trained state replaces it only when its `gain` clears the gate."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from eagle3.checkpoint import save_drafter

        if step == 0:
            self.start = sims
        elif self.step == 0 and gain is not None:  # the start is still the best
            if not gain.clears(self.z) or score <= self.score:  # and never below it overall
                return False
        elif score <= self.score:
            return False
        self.step, self.score = step, score  # every rank: the eval sums are all-reduced
        sd = get_model_state_dict(  # a collective under FSDP: every rank calls
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.enabled:  # save_drafter replaces the previous best atomically
            state = {k.removeprefix("drafter."): v for k, v in sd.items()}
            save_drafter(state, drafter.cfg, self.dir)
            rec = {"step": step, "sim_accept_len": score, "start_batches": self.start}
            atomic_write(self.meta, json.dumps(rec))
        return True


def gate_record(evals: list[dict[str, Any]], best: Best, kept: bool) -> dict[str, Any]:
    """The keep-the-start decision as result.json holds it: the state it judged (the exported
    one, or when the start is kept the trained state scoring highest), its paired gain over the
    start, the gain's standard error, `z` and the eval batches. {} when no trained state was
    evaluated."""
    trained = [m for m in evals if m["step"] > 0 and "eval_gain" in m]
    if not trained:
        return {}
    judged = max(trained, key=lambda m: m["eval_sim_accept_len"])
    if not kept:
        judged = next((m for m in trained if m["step"] == best.step), judged)
    return {"step": judged["step"], "gain": judged["eval_gain"],
            "gain_se": judged.get("eval_gain_se"), "z": best.z,
            "batches": len(best.start or []), "replaced_start": not kept}  # fmt: skip


def gate_line(g: dict[str, Any]) -> str:
    """The `[train]` line of the keep-the-start decision."""
    verdict = "replaces the start" if g["replaced_start"] else "the start is kept"
    se = g["gain_se"]
    bar = f"paired SE {se:.4f}, needs > {g['z']:g} SE = {g['z'] * se:.4f}" if se is not None else "no SE from one batch"  # fmt: skip
    return (
        f"[train] gate: step {g['step']} gains {g['gain']:+.4f} sim_accept over the start on "
        f"{g['batches']} eval batches ({bar}): {verdict}"
    )


def write_drafter_dir(dest: Path, copy_from: Path | None, state: dict, cfg) -> None:
    """The exported drafter folder: a copy of `copy_from`, else `state` saved with `cfg`. It
    replaces what `dest` held atomically (actors/files.py replaced_dir): the old export stays
    whole until the new one is, where it was deleted before the copy began."""
    from eagle3.checkpoint import save_drafter

    with replaced_dir(dest) as tmp:
        if copy_from is not None:
            shutil.copytree(copy_from, tmp, dirs_exist_ok=True)
        else:
            save_drafter(state, cfg, tmp)
