"""The CPU regime: whether a CPU runs the target and the drafter in bf16 (native bf16 matmuls)
or fp32, read from its flags, with a switch to run a bf16 CPU as an fp32 one."""

from __future__ import annotations

import os
from pathlib import Path

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (/proc/cpuinfo) of native bf16 matmuls: with either, bf16 runs several times faster
than fp32 (SmolLM2 decodes 2.3x faster on an AVX512-BF16 CPU); without, torch emulates bf16 and
fp32 is the faster of the two."""

CPU_BF16_ENV = "EAGLE_LOOP_CPU_BF16"
"""`EAGLE_LOOP_CPU_BF16=0` runs a CPU with those flags in the fp32 regime, as a CPU without them
runs (how the demo's fp32 regime is tried on a bf16 machine). Set it before Ray starts: its
workers inherit it."""


def cpu_flags() -> frozenset[str]:
    """This CPU's flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_regime(flags: frozenset[str] | None = None) -> tuple[str, str]:
    """("bf16" or "fp32", why) for a CPU with `flags` (this one's by default): the regime the
    target decodes and the drafter trains in when `target.dtype` / `train.precision` are auto."""
    switch = os.environ.get(CPU_BF16_ENV, "")
    if switch not in ("", "0", "1"):
        raise ValueError(
            f"{CPU_BF16_ENV}={switch!r}: set 0 to run this CPU in the fp32 regime, or 1 (or leave "
            "it unset) to let its flags decide"
        )
    if switch == "0":
        return "fp32", f"{CPU_BF16_ENV}=0 turns this CPU's native bf16 off"
    if flags is None:
        flags = cpu_flags()
        if not flags:  # no /proc/cpuinfo: ask torch (CPUID)
            native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
            return ("bf16", "torch reports native bf16") if native else ("fp32", "no native bf16")
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return "bf16", f"this CPU has {' and '.join(have)}: native bf16 matmuls"
    return (
        "fp32",
        f"this CPU has no {' or '.join(BF16_FLAGS)}: bf16 would be emulated, slower than fp32",
    )


def cpu_has_native_bf16() -> bool:
    """Whether the auto regime on this CPU is bf16 (`cpu_regime`)."""
    return cpu_regime()[0] == "bf16"


def top1(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, computed by `max`: the same index (the first maximum, NaN counting as the
    maximum), but torch's CPU argmax ran 2.2-3.7x slower than `max` over the rows this project
    reduces (greedy picks over a 49,152-token vocab, the drafter's 8,192: 44 against 20 ms for
    [350, 49152] fp32, torch 2.13, one thread), and the data stage, training and the verify
    pass each reduce such rows every step."""
    return x.max(-1).indices


def allocator() -> str:
    """The malloc this process runs under: "jemalloc" where it was preloaded (pipeline/train.py
    `worker_env` does for training workers on CPUs), else "malloc" ("unknown" without /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "jemalloc" if "libjemalloc" in maps else "malloc"


def run_in_background() -> None:
    """Make this process take only the CPU time others leave: every thread it has (and so every
    thread they start) to the idle scheduling class, where Linux has one, else to the lowest
    priority (niceness 19; Ray's workers run at 15). Lowering one's own priority needs no
    privilege."""
    tids = (
        [int(t) for t in os.listdir("/proc/self/task")] if Path("/proc/self/task").is_dir() else [0]
    )
    idle = getattr(os, "SCHED_IDLE", None)
    for tid in tids:
        try:
            if idle is not None:
                os.sched_setscheduler(tid, idle, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except (OSError, AttributeError):  # a thread that ended meanwhile; no such call here
            continue
