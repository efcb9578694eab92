"""`serve --engine sglang|vllm` from the command line: the engine servers the loop itself deploys
(actors/sglang_server.py, actors/vllm_server.py), started by serve/endpoint.py's
`deploy_endpoint` with the command line's settings, until Ctrl-C or SIGTERM.

  python -m serve.cli serve --engine vllm --target smollm2 --drafter drafters/smollm2-135m-offpolicy

The server process runs in a Ray actor that reserves its CPUs and GPUs; its log is under
`--log-dir`. What the engine needs is checked before Ray starts (`missing`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys


def missing(engine: str) -> str | None:
    """What to install before `engine` can serve here, or None."""
    if engine == "sglang" and importlib.util.find_spec("sglang") is None:
        return (
            "--engine sglang: this Python has no sglang; install it with `pip install -e "
            "'.[sglang]'` (sglang 0.5.14, needs a CUDA GPU; docs/sglang.md), or use --engine "
            "embedded"
        )
    if engine == "vllm":
        from actors.vllm_server import PYTHON_ENV, vllm_python

        if vllm_python() is None:
            return (
                "--engine vllm: no Python with vllm found; run `make setup-vllm` (vLLM in its "
                f"own .venv-vllm; docs/vllm.md) or set {PYTHON_ENV} to a Python that has vllm"
            )
    return None


def settings(args: argparse.Namespace) -> tuple[object, object]:
    """(ServeConfig, TargetConfig) from `serve`'s flags, validated as the YAML sections are."""
    from actors.config import TargetConfig
    from serve.config import ServeConfig

    serve_cfg = ServeConfig(
        engine=args.engine,
        host=args.host,
        port=args.port,
        steps=args.steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        extra_args=list(args.extra_arg or []),
    )
    target = TargetConfig(model=args.target, gguf_file=args.gguf_file, dtype=args.dtype)
    return serve_cfg, target


def serve_external(args: argparse.Namespace) -> int:
    """Start the engine's server with `args.drafter` and block; 2 when it cannot start (the
    message says why: what to install, a bad setting, a drafter that does not fit)."""
    if problem := missing(args.engine):
        print(problem, file=sys.stderr, flush=True)
        return 2
    from pydantic import ValidationError

    try:
        serve_cfg, target_cfg = settings(args)
    except ValidationError as e:
        print(f"serve --engine {args.engine}: {e}", file=sys.stderr, flush=True)
        return 2
    import ray

    from actors.cluster import start_ray
    from actors.engine_server import DrafterRejected
    from serve.endpoint import deploy_endpoint
    from serve.startup import serve_until_stopped

    start_ray()
    try:
        ep = deploy_endpoint(serve_cfg, target_cfg, args.drafter, args.log_dir)
    except (DrafterRejected, ValueError, RuntimeError) as e:
        print(f"serve: the {args.engine} server did not start: {e}", file=sys.stderr, flush=True)
        ray.shutdown()
        return 2
    return serve_until_stopped(
        ep.url, {"engine": args.engine, "drafter": args.drafter}, ep.shutdown
    )
