"""Throughput planner: what accept_len (and per-step acceptance) a drafter needs.

Model of one speculative cycle (chain drafting, SGLang/vLLM accounting):
  cycle_ms = steps x draft_ms + verify_ms
`draft_ms` is the time of ONE drafter forward (one draft step); a chain of `steps` drafts runs it
`steps` times. The verify pass scores the drafts and always yields one bonus token, so a cycle
emits accept_len tokens, 1 <= accept_len <= steps + 1, and
  speculative tok/s = accept_len / cycle_s.
Plain decoding emits one token per step of 1/T0 seconds, hence
  break-even accept_len = cycle_s x T0 = cycle_ms / baseline_step_ms
  required accept_len for T tok/s = cycle_s x T.
Per-step acceptance p (each draft accepted with probability p given the previous one was):
unbounded chain 1/(1-p) = A; k steps 1 + p + ... + p^k = A (solved by bisection; no p <= 1
reaches A > k + 1).

Example: 82.5 tok/s baseline (12.12 ms/token) and a 30 ms verify with free drafting need
accept_len 2.475 to break even; 150 tok/s needs 4.5 (p = 0.78), 200 tok/s needs 6.0 (p = 0.83).
"30 ms vs 12.2 ms decode -> 2.46" is the same formula with a 12.2 ms step (82 tok/s).

  python -m pipeline.plan --baseline-tps 82.5 --verify-ms 30 --target-tps 150 --steps 5 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any


def chain_accept_len(p: float, steps: int | None = None) -> float:
    """Expected accept_len (bonus token counted) of a chain with per-step acceptance p."""
    if steps is None:
        return math.inf if p >= 1 else 1.0 / (1.0 - p)
    return float(steps + 1) if p == 1 else sum(p**i for i in range(steps + 1))


def step_acceptance(accept_len: float, steps: int | None = None) -> float | None:
    """Per-step acceptance p giving `accept_len`; None when `steps` cannot reach it."""
    if accept_len <= 1:
        return 0.0
    if steps is None:
        return 1.0 - 1.0 / accept_len
    if accept_len > steps + 1:
        return None
    lo, hi = 0.0, 1.0  # chain_accept_len is increasing in p on [0, 1]
    for _ in range(100):
        mid = (lo + hi) / 2
        if chain_accept_len(mid, steps) < accept_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def plan(
    baseline_tps: float,
    verify_ms: float,
    draft_ms: float = 0.0,
    steps: int | None = None,
    target_tps: float | None = None,
    accept_len: float | None = None,
) -> dict[str, Any]:
    """Break-even and required accept_len / acceptance for one cycle model (see module doc)."""
    if baseline_tps <= 0 or verify_ms <= 0 or draft_ms < 0:
        raise ValueError("--baseline-tps and --verify-ms must be > 0, --draft-ms >= 0")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps {steps}: must be >= 1")
    if draft_ms > 0 and steps is None:
        raise ValueError("--draft-ms is the time of one draft step: pass --steps too")
    if target_tps is not None and target_tps <= 0:
        raise ValueError(f"--target-tps {target_tps}: must be > 0")

    cycle_ms = verify_ms + (steps or 0) * draft_ms
    baseline_step_ms = 1000.0 / baseline_tps
    break_even = cycle_ms / baseline_step_ms
    out: dict[str, Any] = {
        "baseline_tps": baseline_tps,
        "baseline_step_ms": baseline_step_ms,
        "verify_ms": verify_ms,
        "draft_ms_per_step": draft_ms,
        "steps": steps,
        "cycle_ms": cycle_ms,
        "break_even_accept_len": break_even,
        "break_even_step_acceptance": step_acceptance(break_even),
        "target_tps": target_tps,
        "required_accept_len": None,
        "required_step_acceptance": None,
        "reachable": True,
    }
    if steps is not None:
        out["max_tps_with_steps"] = (steps + 1) * 1000.0 / cycle_ms  # every draft accepted
        out["break_even_step_acceptance_k"] = step_acceptance(break_even, steps)
    if target_tps is not None:
        required = target_tps * cycle_ms / 1000.0
        out["required_accept_len"] = required
        out["required_step_acceptance"] = step_acceptance(required)
        out["min_steps"] = max(1, math.ceil(required - 1 - 1e-9))
        if steps is not None:
            out["required_step_acceptance_k"] = step_acceptance(required, steps)
            out["reachable"] = required <= steps + 1
            if not out["reachable"]:
                out["note"] = (
                    f"accept_len {required:.2f} > steps+1 = {steps + 1}: unreachable with "
                    f"{steps} steps; use >= {out['min_steps']} steps or a faster verify"
                )
    if accept_len is not None:
        out["accept_len"] = accept_len
        out["predicted_tps"] = accept_len * 1000.0 / cycle_ms
        out["predicted_speedup"] = out["predicted_tps"] / baseline_tps
    return out


def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.plan") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=f"example:\n  {prog} --baseline-tps 82.5 --verify-ms 30 --target-tps 150 --steps 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--baseline-tps", type=float, required=True, help="plain decoding tok/s (T0)")
    ap.add_argument("--verify-ms", type=float, required=True, help="one verify forward (ms)")
    ap.add_argument(
        "--draft-ms", type=float, default=0.0, help="one draft step (ms); needs --steps"
    )
    ap.add_argument("--steps", type=int, default=None, help="draft steps per cycle (k)")
    ap.add_argument("--target-tps", type=float, default=None, help="tok/s you want (T)")
    ap.add_argument(
        "--accept-len", type=float, default=None, help="predict tok/s for this accept_len"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        res = plan(
            args.baseline_tps,
            args.verify_ms,
            args.draft_ms,
            args.steps,
            args.target_tps,
            args.accept_len,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            if v is not None:
                print(f"{k:30s} {_fmt(v)}")
    return 0 if res["reachable"] else 1


if __name__ == "__main__":
    sys.exit(main())
