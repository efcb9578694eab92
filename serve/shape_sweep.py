"""The serving-shape sweep of the benchmark (embedded engine): requests that ask for a shape,
and the measurements behind serve/shapes.py's `choose_shape`, run by `serve.bench.run_bench`
after its speculative levels (docs/serving.md, "The serving shape")."""

from __future__ import annotations

from typing import Any

import httpx

from serve.bench_stats import (
    LevelResult,
    Prompt,
    RequestBuilder,
    RequestStats,
    _get,
    _run_requests,
    acceptance_per_position,
)
from serve.shapes import (
    PLAIN,
    Shape,
    choose_shape,
    predict_chain,
    speedup_ceiling,
    speedup_spread,
)


def with_shape(build: RequestBuilder, shape: Shape) -> RequestBuilder:
    """`build` whose speculative requests ask for `shape` (a steps sweep's steps ask for that
    chain instead)."""

    def built(prompt: Prompt, max_tokens: int, speculative: bool, steps: int | None):
        path, body = build(prompt, max_tokens, speculative, steps)
        if speculative:
            body = {**body, **(shape if steps is None else Shape(steps)).request_fields()}
        return path, body

    return built


def _pooled_tps(stats: list[RequestStats]) -> float:
    """Completion tokens per second of requests sent one at a time (concurrency 1)."""
    return sum(s.completion_tokens for s in stats) / sum(s.latency_s for s in stats)


def choose_serving_shape(
    client: httpx.Client,
    prompts: list[Prompt],
    build: RequestBuilder,
    bench_cfg: Any,
    configured: Shape,
    configured_level: LevelResult,
    configured_stats: list[RequestStats],
    plain: LevelResult,
) -> dict[str, Any]:
    """Pick the shape to serve (serve/shapes.py's `choose_shape`) among the configured one and
    chains of `bench.shape_chains` steps, on `prompts` (the baseline's, one request at a time):
    the configured shape and plain decoding are already measured; every chain is measured on
    all of `prompts` too, and the fastest measured shape serves (plain when none beats it). The
    longest chain's per-position acceptance and costs give predictions (scaled to its measured
    speedup), recorded beside the measurements as a check of the cost model. Each measured
    shape's speedup comes with its spread over prompts (`speedup_spread`). Returns the record
    for `BenchResult.shape`."""
    max_tokens = _get(bench_cfg, "max_tokens")
    chains = sorted({int(k) for k in _get(bench_cfg, "shape_chains", [])})
    if plain.concurrency != 1 or not plain.verify_ms or not configured_level.verify_ms:
        return {"served": configured.name, **configured.request_fields(),
                "reason": "no choice: shapes are measured at concurrency 1 (bench.concurrency[0])"}  # fmt: skip
    measured: dict[str, float] = {configured.name: _pooled_tps(configured_stats) / plain.tok_per_s}
    tps: dict[str, float] = {
        PLAIN.name: plain.tok_per_s,
        configured.name: _pooled_tps(configured_stats),
    }

    per_shape: dict[str, list[RequestStats]] = {configured.name: configured_stats}

    def measure(s: Shape) -> list[RequestStats]:
        stats, _ = _run_requests(client, prompts, with_shape(build, s), max_tokens, True, None, 1)
        tps[s.name] = _pooled_tps(stats)
        measured[s.name] = tps[s.name] / plain.tok_per_s
        per_shape[s.name] = stats
        return stats

    probe = Shape(chains[-1])
    probe_stats = configured_stats if probe == configured else measure(probe)
    passes = max(1, sum(s.verify_ct or 0 for s in probe_stats))
    hist = [s.accept_hist for s in probe_stats if s.accept_hist]
    acceptance = acceptance_per_position(
        tuple(sum(h[i] for h in hist if i < len(h)) for i in range(probe.steps + 1))
    )
    draft_step_ms = sum(s.draft_ms or 0.0 for s in probe_stats) / passes / probe.steps
    verify = {
        1: plain.verify_ms,
        probe.width: sum(s.verify_ms or 0.0 for s in probe_stats) / passes,
    }
    verify.setdefault(configured.width, configured_level.verify_ms)
    shapes = [configured] + [Shape(k) for k in chains if Shape(k) != configured]
    model = {s.name: predict_chain(s.steps, acceptance, draft_step_ms, verify, plain.verify_ms)
             for s in shapes if s.topk == 1}  # fmt: skip
    # The cost model counts decode passes only; a request also pays prefill and HTTP. Scaled by
    # the probe's measured / modelled speedup, predictions compare with measured speedups.
    scale = measured[probe.name] / model[probe.name] if model[probe.name] > 0 else 1.0
    predicted = {k: v * scale for k, v in model.items()}
    for s in shapes:  # every candidate on every prompt: a choice that holds on other prompts
        if s.name not in measured:
            measure(s)
    spreads = {
        name: speedup_spread([r.completion_tokens for r in st], [r.latency_s for r in st],
                             plain.tok_per_s)._asdict()
        for name, st in per_shape.items()
    }  # fmt: skip
    ceilings = {name: _ceiling(st) for name, st in per_shape.items()}
    choice = choose_shape(shapes, {}, measured, lower={k: v["lo"] for k, v in spreads.items()},
                          ceiling={k: v for k, v in ceilings.items() if v is not None})  # fmt: skip
    return {
        "served": choice.shape.name,
        **{k: getattr(choice.shape, k) for k in ("steps", "topk", "num_draft_tokens")},
        "reason": choice.reason,
        "speedups": choice.speedups,
        "measured": list(measured),
        "predicted_speedups": predicted,
        "measured_speedups": measured,
        "served_tok_per_s": tps[choice.shape.name],
        "served_speedup": measured.get(choice.shape.name, 1.0),
        "served_spread": spreads.get(choice.shape.name),  # None: plain serves (1.0 by definition)
        "spreads": spreads,
        "ceilings": ceilings,
        "accept_lens": {name: _mean_accept(st) for name, st in per_shape.items()},
        "chain_acceptance_per_position": list(acceptance),
        "prediction_scale": scale,
        "costs": {"plain_step_ms": plain.verify_ms, "draft_step_ms": draft_step_ms,
                  "verify_ms_by_width": {str(w): v for w, v in sorted(verify.items())}},
        "prompts": len(prompts),
    }  # fmt: skip


def _ceiling(stats: list[RequestStats]) -> float | None:
    """`speedup_ceiling` over a shape's requests (None: the server reported no timings)."""
    timed = [r for r in stats if r.verify_ct and r.verify_ms is not None]
    return speedup_ceiling(
        sum(r.completion_tokens for r in timed), sum(r.verify_ct or 0 for r in timed),
        sum(r.draft_ms or 0.0 for r in timed), sum(r.verify_ms or 0.0 for r in timed),
    )  # fmt: skip


def _mean_accept(stats: list[RequestStats]) -> float | None:
    """A shape's accept_len: the mean over its requests (None: nothing drafted)."""
    lens = [r.accept_len for r in stats if r.accept_len is not None]
    return sum(lens) / len(lens) if lens else None
