"""Command line for the serving side.

  python -m serve.cli serve --target smollm2 --drafter runs/x/drafters/round-000 --port 8000
  python -m serve.cli bench --url http://127.0.0.1:8000 --num-prompts 16 --max-tokens 64 \
      --concurrency 1,4 --steps-sweep 1,2,3,4 --out runs/bench --tag manual

`serve` starts a local Ray bound to 127.0.0.1 (or joins RAY_ADDRESS), deploys the engine and
blocks until Ctrl-C. `bench` scores any OpenAI-compatible endpoint on the held-out split of the
prompt set (same split as the loop: `--heldout`, `--seed`) and prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    from serve.deployment import deploy
    from serve.startup import ServeStartupError, init_ray

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
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            # "local": a new Ray, never one that `ray start` left on this machine
            init_ray(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)
        ep = deploy(
            serve_cfg,
            target_cfg,
            args.drafter,
            app_name=args.app,
            num_cpus=args.num_cpus,
            torch_threads=args.threads,
            max_batch_size=args.max_batch_size,
        )
    except (ServeStartupError, ConnectionError) as e:
        print(f"serve: the server did not start: {e}", file=sys.stderr, flush=True)
        ray.shutdown()
        return 2
    print(json.dumps({"url": ep.url, "app": ep.app_name, "drafter": ep.drafter}), flush=True)
    stop = threading.Event()  # SIGTERM too: a backgrounded shell job ignores SIGINT
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


def heldout_prompts(jsonl: str | None, heldout: int, seed: int) -> list[Any]:
    """The benchmark's prompts: the held-out split of the built-in set or of a JSONL file."""
    from actors.prompts import builtin_prompts, parse_record, split_prompts

    if jsonl:
        lines = Path(jsonl).read_text().splitlines()
        prompts = [
            parse_record(json.loads(x), f"{jsonl}:{i + 1}")
            for i, x in enumerate(lines)
            if x.strip()
        ]
    else:
        prompts = builtin_prompts(seed)
    return split_prompts(prompts, heldout, seed)[1]


def cmd_bench(args: argparse.Namespace) -> int:
    from serve.bench import run_bench

    prompts = heldout_prompts(args.prompts_jsonl, max(args.heldout, args.num_prompts), args.seed)
    cfg = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "concurrency": _ints(args.concurrency),
        "warmup": args.warmup,
        "steps_sweep": _ints(args.steps_sweep),
        "ignore_eos": args.ignore_eos,
    }
    r = run_bench(args.url, prompts, cfg, args.out, tag=args.tag, timeout_s=args.timeout)
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
        "json": r.json_path,
        "plot": r.plot_path,
    }
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.cli", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="deploy the embedded engine on Ray Serve and block")
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
    s.add_argument("--max-batch-size", type=int, default=8)
    s.add_argument("--app", default="eagle3", help="Serve application name")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint")
    b.add_argument("--url", required=True, help="base URL without /v1, e.g. http://127.0.0.1:8000")
    b.add_argument("--prompts-jsonl", default=None, help="prompt file (default: the built-in set)")
    b.add_argument(
        "--heldout", type=int, default=64, help="held-out split size (as data.heldout_prompts)"
    )
    b.add_argument("--seed", type=int, default=0, help="split seed (as data.seed)")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-tokens (past the EOS)"
    )
    b.add_argument("--concurrency", default="1", help="comma list, e.g. 1,4")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--steps-sweep", default="", help="comma list of steps to try, e.g. 1,2,3,4")
    b.add_argument("--out", default="bench", help="folder for <tag>.json and <tag>.png")
    b.add_argument("--tag", default="bench")
    b.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    b.set_defaults(func=cmd_bench)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
