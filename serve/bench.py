"""Benchmark client: scores a drafter on any OpenAI-compatible endpoint that reports speculative
statistics (this project's engine in `usage`, SGLang in `meta_info`, vLLM in
`metrics.speculative_decoding` plus its Prometheus counters per level: docs/vllm.md). The
requests and their figures are serve/bench_stats.py's; the engines' formats are their adapters'
(actors/engine_server.py's `ResponseSpec` and `SpecCounters`).

One run, at `bench.temperature` (0: greedy, the default) on held-out prompts, each answered up
to `max_tokens` or its end of
sequence (`ignore_eos: true` forces exactly `max_tokens`: the tokens after EOS are text no user
reads, where a drafter trained on real responses accepts less; see docs/serving.md):
  1. warm-up requests (excluded);
  2. optional steps sweep at the first concurrency level: the best steps by output tok/s is kept
     (skipped when the server's steps are fixed at launch: `fixed_steps`, SGLang);
  3. with `accept_concurrency`, the acceptance pass: every prompt, that many in flight (the
     server batches them); accept_len and its per-domain figures come from it, and the speed
     levels below time the baseline's prompts only (`baseline_prompts`). Acceptance belongs to
     the drafter and varies most between prompts, so it wants many of them; speed wants
     requests alone on the server, and a few give it;
  4. each concurrency level with speculation (best steps) and right after it without
     (`speculative: false`: the baseline on the same target and server).
SGLang ignores `speculative` and `steps` in a request, so its baseline comes from a server
without a drafter: `baseline_url`, or figures measured once (`measure_baseline_levels`) and
cached (`bench_endpoint` does this through the endpoint: serve.endpoint.ServingEndpoint).
Reported: accept_len (mean over requests, histogram), output tok/s per request and aggregate,
verify and draft ms, baseline tok/s, speedup, per-position acceptance (fraction of cycles that
accepted >= i drafts) and the measured costs for the planner (`BenchResult.costs` are the keyword
arguments of `pipeline.plan.plan`). Writes `<tag>.json` and `<tag>.png`.

  python -m serve.cli bench --url http://127.0.0.1:8000 --num-prompts 16 --max-tokens 64
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from actors.engine_server import BaselineCache, SpecCounters
from actors.files import atomic_write
from serve.bench_stats import (
    LevelResult,
    Prompt,
    RequestBuilder,
    RequestStats,
    _get,
    _level,
    _run_requests,
    acceptance_per_position,
    chat_request,
    level_from_counters,
)
from serve.shape_sweep import choose_serving_shape, with_shape
from serve.shapes import Shape


@dataclass(frozen=True)
class BenchResult:
    accept_len: float | None
    tok_per_s: float
    baseline_tok_per_s: float
    speedup: float
    acceptance_per_position: tuple[float, ...]  # [i-1] = fraction of cycles accepting >= i drafts
    steps: int | None
    verify_ms: float | None
    draft_ms: float | None  # per draft step
    costs: dict[str, Any]  # keyword arguments of pipeline.plan.plan
    break_even_accept_len: float | None
    accept_len_hist: dict[str, list[float]]  # {"edges": [...], "counts": [...]} over requests
    levels: tuple[LevelResult, ...]
    sweep: tuple[LevelResult, ...]
    json_path: str
    plot_path: str
    extra: dict[str, Any] = field(default_factory=dict)
    domains: dict[str, dict[str, Any]] = field(default_factory=dict)  # per-domain figures
    # the serving shape chosen (serve/shapes.py): {"served", "steps", "topk", "num_draft_tokens",
    # "reason", "speedups", "measured", ...}; empty when no choice was made (fixed-shape servers)
    shape: dict[str, Any] = field(default_factory=dict)


def domain_figures(
    spec: list[RequestStats], base: list[RequestStats], domains: list[str]
) -> dict[str, dict[str, Any]]:
    """accept_len (mean over requests and pooled), per-position acceptance, tok/s and speedup of
    each domain, from the per-request statistics of the first concurrency level (speculative and
    baseline runs of the same prompts, in the same order)."""
    out: dict[str, dict[str, Any]] = {}
    for d in dict.fromkeys(domains):
        idx = [i for i, x in enumerate(domains) if x == d]
        s, b = [spec[i] for i in idx], [base[i] for i in idx]
        lens = [x.accept_len for x in s if x.accept_len is not None]
        verify = sum(x.verify_ct or 0 for x in s)
        hists = [x.accept_hist for x in s if x.accept_hist]
        width = max((len(h) for h in hists), default=0)
        hist = tuple(sum(h[i] for h in hists if i < len(h)) for i in range(width))
        tps = sum(x.completion_tokens for x in s) / max(sum(x.latency_s for x in s), 1e-9)
        base_tps = sum(x.completion_tokens for x in b) / max(sum(x.latency_s for x in b), 1e-9)
        out[d] = {
            "requests": len(s),
            "accept_len": statistics.fmean(lens) if lens else None,
            "accept_len_pooled": sum(x.completion_tokens for x in s) / verify if verify else None,
            "acceptance_per_position": list(acceptance_per_position(hist)),
            "tok_per_s": tps,
            "baseline_tok_per_s": base_tps,
            "speedup": tps / base_tps if base_tps else None,
        }
    return out


def _builder(bench_cfg: Any, build: RequestBuilder | None) -> RequestBuilder:
    """`build`, or chat requests with the config's `ignore_eos` (default false) and sampling
    settings (`temperature`, `top_p`, `top_k`, `seed`: every request the same seed, so requests that
    arrive together still share a batch)."""
    if build is not None:
        return build
    return partial(
        chat_request,
        ignore_eos=bool(_get(bench_cfg, "ignore_eos", False)),
        **sampling(bench_cfg),
    )


def sampling(bench_cfg: Any) -> dict[str, Any]:
    """The benchmark's sampling settings: temperature (0 = greedy), top_p, top_k, seed."""
    return {
        "temperature": float(_get(bench_cfg, "temperature", 0.0)),
        "top_p": float(_get(bench_cfg, "top_p", 1.0)),
        "top_k": int(_get(bench_cfg, "top_k", -1)),
        "seed": _get(bench_cfg, "seed", 0),
    }


def run_bench(
    url: str,
    prompts: list[Prompt],
    bench_cfg: Any,
    out_dir: str | Path,
    *,
    tag: str = "bench",
    build: RequestBuilder | None = None,
    timeout_s: float = 900.0,
    baseline_url: str | None = None,
    baseline: dict[str, Any] | None = None,
    fixed_steps: int | None = None,
    domains: list[str] | None = None,
    counters: Callable[[], SpecCounters | None] | None = None,
    shape: Shape | None = None,
) -> BenchResult:
    """Benchmark `url` on `prompts` (held-out conversations or strings) with `bench_cfg` (a
    BenchConfig or a dict with num_prompts, max_tokens, concurrency, warmup, steps_sweep).
    `domains[i]` names the domain of `prompts[i]`; the result then carries figures per domain
    (`BenchResult.domains`) beside the overall ones. `num_prompts` None = every prompt.

    Baseline: `baseline` (figures from `measure_baseline_levels`, e.g. cached), else measured on
    `baseline_url` (a server without a drafter), else `speculative: false` requests to `url`.
    `fixed_steps`: the server drafts this many steps whatever a request asks (SGLang's
    --speculative-num-steps): the sweep is skipped and the levels are labelled with it.
    `counters`: reads the server's speculative counters (`EngineHandle.spec_counters`, None
    from an engine that keeps none); the speculative levels' accept figures then come from
    their change over each level.
    `shape`: the server's configured drafting shape (the embedded engine, whose requests may ask
    for any shape): the speculative levels ask for it explicitly, and with `bench.shape_chains`
    the serving shape is chosen after them (`choose_serving_shape`, `BenchResult.shape`)."""
    n, max_tokens = _get(bench_cfg, "num_prompts"), _get(bench_cfg, "max_tokens")
    levels_c, warmup = list(_get(bench_cfg, "concurrency")), _get(bench_cfg, "warmup")
    build = _builder(bench_cfg, build)
    plain_build = build
    if shape is not None:
        build = with_shape(build, shape)
    sweep_steps = [] if fixed_steps else list(_get(bench_cfg, "steps_sweep"))
    n = n or len(prompts)
    if len(prompts) < n:
        raise ValueError(
            f"bench.num_prompts={n} but only {len(prompts)} held-out prompts; lower it or hold out more"
        )
    prompts = prompts[:n]
    domains = list(domains[:n]) if domains else ["all"] * n
    n_base = min(n, _get(bench_cfg, "baseline_prompts", None) or n)  # the baseline's prompts
    accept_c = _get(bench_cfg, "accept_concurrency", None)
    n_timed = timed_prompts(bench_cfg, n)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = "same server, speculative: false"
    if baseline is None and baseline_url is not None:
        baseline = measure_baseline_levels(
            baseline_url, prompts, bench_cfg, build=build, timeout_s=timeout_s
        )
        source = baseline_url
    elif baseline is not None:
        source = "given (cached) figures"
    limits = httpx.Limits(max_connections=max(levels_c + [accept_c or 1]) + 2)
    with httpx.Client(base_url=url, timeout=timeout_s, limits=limits) as client:
        for spec in (True, False) if baseline is None else (True,):
            if warmup:
                _run_requests(client, prompts[:warmup], build, max_tokens, spec, None, 1)
        c0 = levels_c[0]
        sweep = []
        for s in sweep_steps:
            stats, wall = _run_requests(client, prompts, build, max_tokens, True, s, c0)
            sweep.append(_level(stats, c0, True, s, wall))
        best = fixed_steps or (max(sweep, key=lambda lv: lv.tok_per_s).steps if sweep else None)
        levels, first, counted, accepted = [], None, [], None

        def measured(c: int, batch: list[Prompt]) -> tuple[LevelResult, list[RequestStats]]:
            before = counters() if counters else None  # None: the engine keeps no counters
            stats, wall = _run_requests(client, batch, build, max_tokens, True, best, c)
            level = _level(stats, c, True, best, wall)
            if counters and before is not None:
                delta = counters() - before
                level = level_from_counters(level, stats, delta)
                counted.append(
                    {
                        "concurrency": c,
                        "drafts": delta.drafts,
                        "accept_len": delta.accept_len,
                        "acceptance_per_position": list(delta.acceptance_per_position),
                    }
                )
            return level, stats

        if accept_c:
            accepted = measured(accept_c, prompts)
        for c in levels_c:  # speculative and baseline back to back: drifting load hits both
            level, stats = measured(c, prompts[:n_timed])
            levels.append(level)
            if baseline is not None:
                levels.append(_baseline_level(baseline, c))
                base_stats = stats  # no per-request baseline: per-domain speedup stays overall
            else:
                base_stats, wall = _run_requests(client, prompts[:n_base], build, max_tokens, False, None, c)  # fmt: skip
                levels.append(_level(base_stats, c, False, None, wall))
                if n_base < n_timed:
                    base_stats = stats  # per-domain speedups need every prompt's baseline
            first = first or (stats, base_stats)
        chosen = {}
        if shape is not None and _get(bench_cfg, "shape_chains", []):
            chosen = choose_serving_shape(
                client, prompts[:n_base], plain_build, bench_cfg, shape,
                levels[0], first[0][:n_base], levels[1],
            )  # fmt: skip
    settings = {
        "url": url,
        "num_prompts": n,
        "max_tokens": max_tokens,
        "ignore_eos": bool(_get(bench_cfg, "ignore_eos", False)),
        "concurrency": levels_c,
        "warmup": warmup,
        "steps_sweep": sweep_steps,
        "fixed_steps": fixed_steps,
        "baseline": source,
        "baseline_prompts": n_base,
        "accept_concurrency": accept_c,
        **sampling(bench_cfg),
    }
    if accepted is not None:  # per-domain acceptance over every prompt; speed stays overall
        per_domain = domain_figures(accepted[1], accepted[1], domains)
        for d in per_domain.values():
            d["tok_per_s"] = None  # batched requests: no speed of their own
    else:
        per_domain = domain_figures(first[0], first[1], domains)
    if baseline is not None or n_base < n:
        for d in per_domain.values():
            d["baseline_tok_per_s"] = d["speedup"] = None
    acc_level = accepted[0] if accepted is not None else None
    return _summarize(levels, sweep, out, tag, settings, counted, per_domain, chosen, acc_level)


def timed_prompts(bench_cfg: Any, n: int) -> int:
    """How many of the `n` prompts the speed levels time: the baseline's (`baseline_prompts`)
    when an acceptance pass scores every prompt (`accept_concurrency`), else all."""
    if not _get(bench_cfg, "accept_concurrency", None):
        return n
    return min(n, _get(bench_cfg, "baseline_prompts", None) or n)


def measure_baseline_levels(
    url: str,
    prompts: list[Prompt],
    bench_cfg: Any,
    *,
    build: RequestBuilder | None = None,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """No-speculation figures of `url` at every concurrency level of `bench_cfg` (warm-up
    first): {"levels": [LevelResult as dict]}; what `run_bench(baseline=...)` takes and what
    `BaselineCache` stores."""
    n, max_tokens = _get(bench_cfg, "num_prompts"), _get(bench_cfg, "max_tokens")
    levels_c, warmup = list(_get(bench_cfg, "concurrency")), _get(bench_cfg, "warmup")
    build = _builder(bench_cfg, build)
    prompts = prompts[: timed_prompts(bench_cfg, n or len(prompts))]
    limits = httpx.Limits(max_connections=max(levels_c) + 2)
    levels = []
    with httpx.Client(base_url=url, timeout=timeout_s, limits=limits) as client:
        if warmup:
            _run_requests(client, prompts[:warmup], build, max_tokens, False, None, 1)
        for c in levels_c:
            stats, wall = _run_requests(client, prompts, build, max_tokens, False, None, c)
            levels.append(asdict(_level(stats, c, False, None, wall)))
    return {"url": url, "levels": levels}


def bench_settings_key(prompts: list[Prompt], bench_cfg: Any) -> str:
    """Identity of what a baseline measured (prompts, lengths, levels): its cache key part."""
    n = _get(bench_cfg, "num_prompts")
    what = {k: _get(bench_cfg, k) for k in ("num_prompts", "max_tokens", "concurrency", "warmup")}
    what["baseline_prompts"] = _get(bench_cfg, "baseline_prompts", None)
    what["ignore_eos"] = bool(_get(bench_cfg, "ignore_eos", False))
    what.update(sampling(bench_cfg))  # plain sampling's speed is its own baseline
    blob = json.dumps({**what, "prompts": prompts[:n]}, sort_keys=True, default=str)
    return "bench-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def _baseline_level(baseline: dict[str, Any], concurrency: int) -> LevelResult:
    for d in baseline.get("levels", []):
        if d["concurrency"] == concurrency:
            d = {
                **d,
                "accept_lens": tuple(d["accept_lens"]),
                "accept_hist": tuple(d["accept_hist"]),
            }
            return LevelResult(**d)
    raise ValueError(
        f"baseline figures have no level at concurrency {concurrency}; they were measured with "
        "other bench settings: delete that baseline cache entry to measure it again"
    )


def bench_endpoint(
    endpoint: Any,
    prompts: list[Prompt],
    bench_cfg: Any,
    out_dir: str | Path,
    *,
    baseline_cache: str | Path,
    tag: str = "bench",
    timeout_s: float = 900.0,
    domains: list[str] | None = None,
) -> BenchResult:
    """`run_bench` the way the endpoint's engine needs (a serve.endpoint.ServingEndpoint):
    embedded = baseline per request on the same replica and the steps sweep; SGLang = steps fixed
    at launch and the baseline from `baseline_cache` or measured once by restarting the endpoint
    without its drafter (the speculative server holds the GPUs a second server would need).
    `bench.reuse_baseline` (embedded): the first run's baseline levels go into `baseline_cache`
    and later runs on the same prompts and settings reuse them (the target without a drafter does
    not change between rounds; per-domain speedups are then left out)."""
    key = bench_settings_key(prompts, bench_cfg)
    got = endpoint.baseline(
        lambda url: measure_baseline_levels(url, prompts, bench_cfg, timeout_s=timeout_s),
        baseline_cache,
        key,
    )
    baseline, cached = got if got is not None else (None, False)
    reuse = got is None and bool(_get(bench_cfg, "reuse_baseline", False))
    cache = BaselineCache(Path(baseline_cache))
    if reuse and (hit := cache.get(key)) is not None:
        baseline, cached = hit, True
    result = run_bench(
        endpoint.url,
        prompts,
        bench_cfg,
        out_dir,
        tag=tag,
        timeout_s=timeout_s,
        baseline=baseline,
        fixed_steps=endpoint.fixed_steps,
        domains=domains,
        counters=getattr(endpoint, "spec_counters", None),
        shape=getattr(endpoint, "shape", None),  # the embedded engine: requests pick shapes
    )
    if reuse and not cached:
        levels = [asdict(lv) for lv in result.levels if not lv.speculative]
        cache.put(key, {"url": endpoint.url, "levels": levels,
                        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})  # fmt: skip
    result.extra["baseline_cached"] = cached
    atomic_write(result.json_path, json.dumps(asdict(result), indent=2) + "\n")
    return result


def _summarize(
    levels: list[LevelResult],
    sweep: list[LevelResult],
    out: Path,
    tag: str,
    settings: dict[str, Any],
    counters: list[dict[str, Any]] | None = None,
    domains: dict[str, dict[str, Any]] | None = None,
    shape: dict[str, Any] | None = None,
    accepted: LevelResult | None = None,
) -> BenchResult:
    """The result: speed from the first concurrency level, acceptance from `accepted` (the
    acceptance pass over every prompt) when there is one, else from that level too."""
    c0 = levels[0].concurrency
    spec = next(lv for lv in levels if lv.speculative and lv.concurrency == c0)
    base = next(lv for lv in levels if not lv.speculative and lv.concurrency == c0)
    acc = accepted or spec
    costs: dict[str, Any] = {
        "baseline_tps": base.tok_per_s,
        "verify_ms": spec.verify_ms,
        "draft_ms": spec.draft_ms_per_step or 0.0,
        "steps": spec.steps,
        "accept_len": acc.accept_len,
    }
    break_even = None
    if spec.verify_ms is not None and spec.steps:
        break_even = (
            (spec.verify_ms + spec.steps * (spec.draft_ms_per_step or 0.0))
            * base.tok_per_s
            / 1000.0
        )
    edges, counts = _histogram(acc.accept_lens, acc.steps)
    result = BenchResult(
        accept_len=acc.accept_len,
        tok_per_s=spec.tok_per_s,
        baseline_tok_per_s=base.tok_per_s,
        speedup=spec.tok_per_s / base.tok_per_s,
        acceptance_per_position=acceptance_per_position(acc.accept_hist),
        steps=spec.steps,
        verify_ms=spec.verify_ms,
        draft_ms=spec.draft_ms_per_step,
        costs=costs,
        break_even_accept_len=break_even,
        accept_len_hist={"edges": edges, "counts": counts},
        levels=tuple(levels),
        sweep=tuple(sweep),
        json_path=str(out / f"{tag}.json"),
        plot_path=str(out / f"{tag}.png"),
        extra={"settings": settings, "baseline_verify_ms": base.verify_ms}
        | ({"server_counters": counters} if counters else {})
        | ({"acceptance_level": asdict(accepted)} if accepted else {}),
        domains=domains or {},
        shape=shape or {},
    )
    atomic_write(result.json_path, json.dumps(asdict(result), indent=2) + "\n")
    plot(result)
    return result


def _histogram(values: tuple[float, ...], steps: int | None) -> tuple[list[float], list[float]]:
    """Counts of per-request accept_len in bins of 0.25 from 1 to steps+1."""
    bins = 4 * (steps or 1)
    edges = [1.0 + 0.25 * i for i in range(bins + 1)]
    counts = [0.0] * bins
    for v in values:
        counts[min(max(int((v - 1.0) / 0.25), 0), bins - 1)] += 1
    return edges, counts


def plot(result: BenchResult) -> str:
    """Four panels: accept_len histogram, acceptance per position, tok/s per concurrency (with the
    baseline), and the steps sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    ax = axes[:, :2]
    names = list(result.domains)
    vals = [result.domains[d]["accept_len"] or 0 for d in names]
    axes[0, 2].bar(range(len(names)), vals)
    axes[0, 2].set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes[0, 2].set(title="accept_len per domain", ylabel="accept_len")
    for d in names:
        acc = result.domains[d]["acceptance_per_position"]
        axes[1, 2].plot(range(1, len(acc) + 1), acc, "o-", label=d)
    axes[1, 2].set(
        title="acceptance per position by domain", xlabel="draft position i", ylim=(0, 1)
    )
    if names:
        axes[1, 2].legend()
    h = result.accept_len_hist
    if h["counts"]:
        ax[0, 0].bar(h["edges"][:-1], h["counts"], width=0.23, align="edge")
    ax[0, 0].set(
        title=f"accept_len per request (mean {result.accept_len or 0:.2f})",
        xlabel="accept_len",
        ylabel="requests",
    )
    rates = result.acceptance_per_position
    ax[0, 1].bar(range(1, len(rates) + 1), rates)
    ax[0, 1].set(
        title="acceptance per position",
        xlabel="draft position i",
        ylabel="cycles accepting >= i",
        ylim=(0, 1),
    )
    for spec, label in ((True, "speculative"), (False, "baseline")):
        lv = [x for x in result.levels if x.speculative == spec]
        ax[1, 0].plot([x.concurrency for x in lv], [x.tok_per_s for x in lv], "o-", label=label)
    ax[1, 0].set(
        title=f"output tok/s (speedup {result.speedup:.2f}x)", xlabel="concurrency", ylabel="tok/s"
    )
    ax[1, 0].legend()
    if result.sweep:
        ax[1, 1].plot(
            [x.steps for x in result.sweep],
            [x.tok_per_s for x in result.sweep],
            "o-",
            label="tok/s",
        )
        ax2 = ax[1, 1].twinx()
        ax2.plot(
            [x.steps for x in result.sweep],
            [x.accept_len or 0 for x in result.sweep],
            "s--",
            color="C1",
            label="accept_len",
        )
        ax2.set_ylabel("accept_len")
    ax[1, 1].set(title=f"steps sweep (best {result.steps})", xlabel="steps", ylabel="tok/s")
    fig.tight_layout()
    fig.savefig(result.plot_path, dpi=100)
    plt.close(fig)
    return result.plot_path
