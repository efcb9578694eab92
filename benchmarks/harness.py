"""What every script in benchmarks/ shares: the parser and its `--device` flag, the device itself,
a timing helper, and the one JSON line a result prints.

Every result line carries where and when it was measured (`device`, `date`, `torch`,
`transformers`, `cpu_count`, `loadavg_1m`) and the script's `bench` name; it is printed, and
appended to `$OUT/<bench>.jsonl` when `$OUT` is set (the device machine sends `$OUT` back).
Benchmarks call the product's functions; this module holds only the measuring around them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def parser(
    doc: str | None,
    device: str | None = None,
    shapes: dict[str, Any] | None = None,
    shape: str | None = None,
    iters: int | None = None,
) -> argparse.ArgumentParser:
    """A parser whose help is the script's docstring, with the flags the scripts share where
    asked for: `--device` (`device` is its default: "cuda", "cpu" or "auto", CUDA where torch
    sees it), `--shape` (one of `shapes`, default `shape`), `--iters` (timed calls, default
    `iters`)."""
    head, _, rest = (doc or "").partition("\n\n")
    ap = argparse.ArgumentParser(
        description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if device:
        default = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        ap.add_argument(
            "--device",
            choices=["cpu", "cuda"],
            default=default,
            help=f"where to run (default {default}); cpu with the smallest shape is a smoke test",
        )
    if shapes:
        ap.add_argument("--shape", choices=sorted(shapes), default=shape or next(iter(shapes)))
    if iters:
        ap.add_argument("--iters", type=int, default=iters, help="timed calls per measurement")
    return ap


def add_training_args(
    ap: argparse.ArgumentParser, tokens_per_batch: int, ttt: int, threads: int
) -> None:
    """The recipe's flags shared by the scripts that train (epochs, lr, batch, TTT, samples)."""
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tokens-per-batch", type=int, default=tokens_per_batch)
    ap.add_argument("--ttt", type=int, default=ttt, help="TTT length k")
    ap.add_argument("--train-samples", type=int, default=0, help="train on the first N (0: all)")
    ap.add_argument("--threads", type=int, default=threads, help="torch threads (0: torch's own)")


def pick_device(name: str) -> torch.device:
    """`--device` as a torch device with its index ("cuda" is the current CUDA device, which
    becomes the default one); CUDA asked for where torch sees none is refused."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                f"--device {name}: torch sees no CUDA device here; use --device cpu "
                "(with the smallest --shape for a smoke test)"
            )
        if device.index is None:  # set_device refuses one without (issue 50: a crash on CUDA)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def device_name(device: torch.device | str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu:{platform.processor() or platform.machine()}"


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def clocked(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, float]:
    """fn()'s result and its seconds: the host clock around a call synchronized with the device
    before and after (for calls of milliseconds and more)."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def timed_ms(fn: Callable[[], Any], device: torch.device | str, iters: int, warm: int = 0) -> list[float]:  # fmt: skip
    """ms of each of `iters` clocked calls after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    return [clocked(fn, device)[1] * 1000 for _ in range(iters)]


def median_ms(fn: Callable[[], Any], device: torch.device | str, iters: int, warm: int = 3) -> float:  # fmt: skip
    return statistics.median(timed_ms(fn, device, iters, warm))


def environment(device: torch.device | str) -> dict[str, Any]:
    """Where and when: the fields every result line starts with."""
    import transformers

    return {
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


@dataclass
class Results:
    """`emit(record)` prints one JSON line (`bench`, the environment, `base`, the record) and
    appends it to $OUT/<bench>.jsonl when OUT is set."""

    bench: str
    device: torch.device | str = "cpu"
    base: dict[str, Any] = field(default_factory=dict)

    def emit(self, record: dict[str, Any]) -> dict[str, Any]:
        line = {"bench": self.bench, **environment(self.device), **self.base, **record}
        text = json.dumps(line)
        print(text, flush=True)
        if os.environ.get("OUT"):
            with open(Path(os.environ["OUT"]) / f"{self.bench}.jsonl", "a") as f:
                f.write(text + "\n")
        return line


@dataclass(frozen=True)
class DrafterShape:
    """A drafter's dimensions (SGLang's LlamaForCausalLMEagle3 config); `ttt` the TTT length a
    step of this shape is measured at, `target_hidden` 0 for the drafter's own hidden size."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    ttt: int = 7
    target_hidden: int = 0

    def config(self, draft_vocab: int | None = None, **extra: Any):
        """The product's drafter config of this shape (aux layers 1, 2, 3: synthetic inputs)."""
        from eagle3.config import Eagle3Config

        return Eagle3Config(
            hidden_size=self.hidden,
            intermediate_size=self.inter,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab,
            draft_vocab_size=draft_vocab or self.draft_vocab,
            target_hidden_size=self.target_hidden or self.hidden,
            aux_layer_ids=[1, 2, 3],
            **extra,
        )
