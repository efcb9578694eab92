"""Command line for the serving side.

  python -m serve.cli serve --target smollm2 --drafter runs/x/train/round-000/drafter --port 8000
  python -m serve.cli bench --url http://127.0.0.1:8000 --num-prompts 16 --max-tokens 64 \
      --concurrency 1,4 --steps-sweep 1,2,3,4 --out runs/bench --tag manual

  python -m serve.cli swap --url http://127.0.0.1:8000 --drafter runs/x/train/round-001/drafter

`serve` starts a local Ray bound to 127.0.0.1 (or joins RAY_ADDRESS), deploys the engine and
blocks until Ctrl-C. `swap` hot-swaps the drafter of that server: it asks the server (GET
/drafter) for its app and instance id, joins its Ray (`--address`, default the one on this
machine), checks through the Serve handle that the app there is that same server (another
server's app of the same name is refused, naming both ids: exit 1) and swaps as the loop does
(the replica checks the checkpoint first; a refused one exits 1 and the old drafter keeps
serving). `bench`
scores any OpenAI-compatible endpoint on every prompt of the files given (one domain per file)
or suites given, else on the loop's own held-out split of real prompts (the prompt sources of
`--config`'s data section, or `real`'s; `serve/bench_prompts.py`), and prints the summary,
overall and per domain, as JSON. `serve --engine sglang|vllm` starts that engine's server
instead of the embedded one (serve/external.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_serve(args: argparse.Namespace) -> int:
    if args.engine != "embedded":
        from serve.external import serve_external

        return serve_external(args)
    import ray
    from ray import serve

    from actors.cluster import RayStartError, start_ray
    from serve.endpoint import deploy
    from serve.startup import ServeStartupError, check_port, serve_until_stopped

    serve_cfg = {
        "host": args.host,
        "port": args.port,
        "steps": args.steps,
        "topk": args.topk,
        "num_draft_tokens": args.num_draft_tokens,
        "num_gpus": args.num_gpus,
    }
    target_cfg = {"model": args.target, "gguf_file": args.gguf_file, "dtype": args.dtype}
    try:  # start-up is retried inside; what is left is a message, not a traceback
        if not os.environ.get("RAY_ADDRESS"):  # a new local Ray: no Serve can hold the port yet,
            check_port(args.host, args.port)  # so a taken one is refused before Ray starts
        start_ray()
        ep = deploy(
            serve_cfg,
            target_cfg,
            args.drafter,
            app_name=args.app,
            num_cpus=args.num_cpus,
            torch_threads=args.threads,
            max_batch_size=args.max_batch_size,
        )
    except (ServeStartupError, RayStartError, ConnectionError) as e:
        print(f"serve: the server did not start: {e}", file=sys.stderr, flush=True)
        ray.shutdown()
        return 2
    return serve_until_stopped(ep.url, {"app": ep.app_name, "drafter": ep.drafter}, serve.shutdown)


def cmd_swap(args: argparse.Namespace) -> int:
    # `serve`'s local Ray has token auth on (Ray 2.60's default for a new local cluster, token in
    # ~/.ray/auth_token); a driver joining it must send the token too. Read when Ray is imported.
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import httpx

    from actors.cluster import start_ray
    from actors.engine_server import DrafterRejected
    from serve.endpoint import adopt_app, swap_drafter

    info = httpx.get(f"{args.url.rstrip('/')}/drafter", timeout=60).json()
    start_ray(address=args.address)  # the server's own Ray (GET /drafter never names it)
    reached = adopt_app(info["app"])
    if not info.get("instance") or reached.get("instance") != info["instance"]:
        import ray

        print(
            f"swap refused: {args.url} is server instance {info.get('instance')!r}, but app "
            f"{info['app']!r} on the Ray at {ray.get_runtime_context().gcs_address} (--address "
            f"{args.address}) is instance {reached.get('instance')!r}, another server; pass "
            "--address of the Ray that this server's `serve.cli serve` started",
            file=sys.stderr,
        )
        return 1
    try:
        out = swap_drafter(Path(args.drafter).resolve(), info["app"])
    except DrafterRejected as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps({k: out[k] for k in ("app", "path", "swaps", "pid")}), flush=True)
    return 0


# Standard suites by HF dataset id (need the `datasets` package and a network): id, config,
# split, the field holding the first user turn.
SUITES: dict[str, tuple[str, str | None, str, str]] = {
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
    "gsm8k": ("openai/gsm8k", "main", "test", "question"),
    "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
    "math-500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
}


def suite_prompts(name: str) -> tuple[list[Any], list[str]]:
    """A standard benchmark suite's prompts (first user turns), all in domain `name`."""
    import importlib

    from serve.bench_prompts import suite_load_error

    if name not in SUITES:
        raise SystemExit(f"--suite {name!r}: unknown; use one of {sorted(SUITES)}")
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise SystemExit(f"--suite {name}: needs `pip install datasets` and a network") from None
    repo, config, split, key = SUITES[name]
    print(f"--suite {name}: loading {repo} ({split}) from the Hugging Face Hub", file=sys.stderr)
    try:
        rows = datasets.load_dataset(repo, config, split=split)
    except Exception as e:  # offline, no such revision, a gated set: a message, not a traceback
        raise SystemExit(suite_load_error(name, repo, e)) from None
    texts = [r[key][0] if isinstance(r[key], list) else r[key] for r in rows]
    return [[{"role": "user", "content": t}] for t in texts], [name] * len(texts)


def bench_prompts(args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """(prompts, domain of each): every prompt of the given files (one domain per file, or a
    record's `domain`) and suites, else the loop's held-out split of real prompts."""
    from actors.prompts import interleave, load_jsonl_prompts
    from serve.bench_prompts import check_suites, heldout_prompts

    check_suites(args.suite or [])  # what they need, before any prompt is read

    groups = [load_jsonl_prompts(Path(f)) for f in args.prompts_jsonl or []]
    prompts = [p for g in groups for p in g]
    out = [p.messages for p in prompts], [p.domain for p in prompts]
    if args.interleave:
        mixed = interleave(groups)
        out = [p.messages for p in mixed], [p.domain for p in mixed]
    for name in args.suite or []:
        convs, doms = suite_prompts(name)
        out = out[0] + convs, out[1] + doms
    if out[0]:
        return out
    return heldout_prompts(args.config, args.set, heldout=args.heldout, seed=args.seed)


def cmd_bench(args: argparse.Namespace) -> int:
    from serve.bench import run_bench

    prompts, domains = bench_prompts(args)
    cfg = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "concurrency": _ints(args.concurrency),
        "warmup": args.warmup,
        "steps_sweep": _ints(args.steps_sweep),
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.sampling_seed,
        "shape_chains": _ints(args.shape_chains),
        "baseline_prompts": args.baseline_prompts,
        "accept_concurrency": args.accept_concurrency,
    }
    r = run_bench(
        args.url, prompts, cfg, args.out, tag=args.tag, timeout_s=args.timeout, domains=domains,
        shape=args.shape,
    )  # fmt: skip
    summary = {
        "accept_len": r.accept_len,
        "tok_per_s": r.tok_per_s,
        "baseline_tok_per_s": r.baseline_tok_per_s,
        "speedup": r.speedup,
        "steps": r.steps,
        "verify_ms": r.verify_ms,
        "draft_ms_per_step": r.draft_ms,
        "break_even_accept_len": r.break_even_accept_len,
        "acceptance_per_position": r.acceptance_per_position,
        "domains": r.domains,
        "shape": r.shape,
        "json": r.json_path,
        "plot": r.plot_path,
    }
    print(json.dumps(summary, indent=2))
    return 0


def _shape(text: str):
    """--shape `steps,topk,num_draft_tokens`, refused by argparse (exit 2, the flag named)."""
    from serve.shapes import Shape

    try:
        steps, topk, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give steps,topk,num_draft_tokens, e.g. 5,4,12 (a chain of 3: 3,1,4)"
        ) from None
    if steps < 1 or topk < 1 or n < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: steps and topk >= 1, num_draft_tokens >= 2")
    return Shape(steps, topk, n)


def _batch_size(text: str) -> int:
    """--max-batch-size, refused by argparse (exit 2, the flag named) before any Ray starts."""
    from serve.config import batch_problem

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if problem := batch_problem(n, 0.0):
        raise argparse.ArgumentTypeError(problem)
    return n


def _example(text: str) -> dict[str, Any]:
    """A subcommand's `--help` epilog: one example."""
    return {
        "epilog": f"example:\n  {text}",
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }


def main(argv: list[str] | None = None, prog: str = "python -m serve.cli") -> int:
    from actors.config import add_set_argument

    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser(
        "serve",
        help="deploy a drafter (embedded engine on Ray Serve, or SGLang / vLLM) and block",
        **_example(
            f"{prog} serve --target smollm2 --drafter drafters/smollm2-135m-offpolicy --port 8000"
        ),  # fmt: skip
    )
    s.add_argument(
        "--engine",
        default="embedded",
        choices=["embedded", "sglang", "vllm"],
        help="embedded: the project's engine on Ray Serve; sglang / vllm: that engine's server in "
        "a Ray actor (needs the engine installed: serve/external.py)",
    )
    s.add_argument("--target", default="smollm2", help="HF repo id, local folder, or `smollm2`")
    s.add_argument("--gguf-file", default=None, help="GGUF file inside --target")
    s.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument(
        "--drafter", default=None, help="EAGLE-3 checkpoint folder (none = plain decoding)"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--steps", type=int, default=3, help="default draft steps per cycle")
    s.add_argument("--topk", type=int, default=1, help="draft tree branching (1 = chain)")
    s.add_argument(
        "--num-draft-tokens", type=int, default=None, help="tree: tokens per verify (root included)"
    )
    s.add_argument("--num-cpus", type=float, default=1.0, help="CPUs the replica reserves")
    s.add_argument("--num-gpus", type=float, default=0.0)
    s.add_argument("--threads", type=int, default=None, help="torch threads in the replica")
    s.add_argument("--max-batch-size", type=_batch_size, default=8, help="requests per batch")
    s.add_argument("--app", default="eagle3", help="Serve application name")
    s.add_argument(
        "--extra-arg",
        action="append",
        metavar="ARG",
        help="sglang / vllm: one more server argument, e.g. --extra-arg=--max-model-len=2048",
    )
    s.add_argument("--log-dir", default="serve-logs", help="sglang / vllm: the server's logs")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser(
        "swap",
        help="hot-swap the drafter of a running `serve`",
        **_example(
            f"{prog} swap --url http://127.0.0.1:8000 --drafter runs/x/train/round-001/drafter"
        ),
    )
    w.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    w.add_argument("--drafter", required=True, help="EAGLE-3 checkpoint folder")
    w.add_argument(
        "--address",
        default="auto",
        help="the server's Ray (default: the Ray running on this machine); the server does not "
        "publish it",
    )
    w.set_defaults(func=cmd_swap)

    b = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible endpoint",
        **_example(
            f"{prog} bench --url http://127.0.0.1:8000 --config configs/smollm2-cpu.yaml "
            "--num-prompts 12 --max-tokens 64"
        ),  # fmt: skip
    )
    b.add_argument("--url", required=True, help="base URL without /v1, e.g. http://127.0.0.1:8000")
    b.add_argument(
        "--prompts-jsonl",
        action="append",
        help="prompt file, benchmarked whole, one domain per file (repeatable; default: the "
        "loop's held-out split of real prompts, see --config)",
    )
    b.add_argument(
        "--suite",
        action="append",
        choices=list(SUITES),
        help="a standard suite, downloaded from the Hugging Face Hub (needs `pip install "
        "datasets` and a network)",
    )
    b.add_argument(
        "--config",
        default=None,
        help="the loop's config: its data section's held-out prompts (and bench.eval_files) are "
        "the default prompts; without it, those of data.source `real`",
    )
    add_set_argument(b)
    b.add_argument(
        "--interleave",
        action="store_true",
        help="alternate the files' prompts (with --num-prompts)",
    )
    b.add_argument(
        "--heldout",
        type=int,
        default=None,
        help="held-out prompts per source (data.heldout_prompts)",
    )
    b.add_argument("--seed", type=int, default=None, help="split seed (data.seed)")
    b.add_argument(
        "--num-prompts", type=int, default=None, help="first N prompts (default: all of them)"
    )
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-tokens (past the EOS)"
    )
    b.add_argument("--concurrency", default="1", help="comma list, e.g. 1,4")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--steps-sweep", default="", help="comma list of steps to try, e.g. 1,2,3,4")
    b.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus of sampled requests")
    b.add_argument(
        "--top-k", type=int, default=-1, help="top-k cut of sampled requests (-1 or 0: off)"
    )
    b.add_argument("--sampling-seed", type=int, default=0, help="seed of sampled requests")
    b.add_argument(
        "--shape",
        type=_shape,
        default=None,
        help="the embedded server's drafting shape, steps,topk,num_draft_tokens (e.g. 5,4,12): "
        "with --shape-chains, each shape's accept_len and speedup over plain decoding",
    )
    b.add_argument(
        "--shape-chains", default="", help="chains to measure beside --shape, e.g. 1,2,3"
    )
    b.add_argument("--baseline-prompts", type=int, default=None,
                   help="time speed on the first N prompts only (bench.baseline_prompts)")  # fmt: skip
    b.add_argument("--accept-concurrency", type=int, default=None,
                   help="score acceptance on every prompt, N in flight (bench.accept_concurrency)")  # fmt: skip
    b.add_argument("--out", default="bench", help="folder for <tag>.json and <tag>.png")
    b.add_argument("--tag", default="bench")
    b.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    b.set_defaults(func=cmd_bench)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
