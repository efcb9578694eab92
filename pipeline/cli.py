"""`eagle-loop`: the one command (pyproject.toml `[project.scripts]`). Each subcommand runs the
entry point that does the work, with its own flags; `eagle-loop <command> --help` shows them and
an example.

  eagle-loop run --config configs/smollm2-cpu.yaml          # the loop (python pipeline/run.py)
  eagle-loop preflight --config configs/llama31-8b-1gpu.yaml

Exit codes (pipeline/exit_codes.py): 0 done, 1 failed, 2 usage, 3 config or preflight,
4 busy run directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.exit_codes import BUSY, CONFIG, FAILED, OK, TABLE, USAGE

PROG = "eagle-loop"


@dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[list[str]], int | None]  # argv after the command's name -> exit code


def _run(argv: list[str]) -> int:
    from pipeline.run import main

    return main(argv, prog=f"{PROG} run")


def _env(name: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from pipeline.run import env_main

        return env_main([name, *argv], prog=PROG)

    return run


def _preflight(argv: list[str]) -> int:
    from pipeline.preflight import main

    return main(argv, prog=f"{PROG} preflight")


def _compat(argv: list[str]) -> int:
    from pipeline.compat import main

    return main(argv, prog=f"{PROG} compat")


def _plan(argv: list[str]) -> int:
    from pipeline.plan import main

    return main(argv, prog=f"{PROG} plan")


def _generate(argv: list[str]) -> int:
    from actors.generate import main

    main(argv, prog=f"{PROG} generate")
    return OK


def _train(argv: list[str]) -> int:
    import logging

    from pipeline.train import main

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main(argv, prog=f"{PROG} train")
    return OK


def _serving(name: str) -> Callable[[list[str]], int]:
    """serve.cli's `serve`, `swap` and `bench`. serve.cli returns 2 when a server did not start
    (a taken port, a missing engine, a drafter refused) and 1 when a swap was refused: both
    are FAILED here, 2 being the usage status."""

    def run(argv: list[str]) -> int:
        from serve.cli import main

        if name == "serve" and (engine := _engine(argv)) and engine != "embedded":
            from serve.external import missing

            if problem := missing(engine):  # what to install, before Ray starts
                print(problem, file=sys.stderr)
                return CONFIG
        code = main([name, *argv], prog=PROG)
        return OK if code == 0 else FAILED

    return run


def _engine(argv: list[str]) -> str | None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--engine")
    return ap.parse_known_args(argv)[0].engine


def _pack(argv: list[str]) -> int:
    from pipeline.pack import main

    return main(argv, prog=f"{PROG} pack")


def _ui(argv: list[str]) -> int:
    """The MLflow UI of a run directory (what `make ui` runs)."""
    ap = argparse.ArgumentParser(
        prog=f"{PROG} ui",
        description="The MLflow UI of a run's own store (<run-dir>/mlflow.db) on loopback, "
        "after the run (or `make demo`) has ended.",
        epilog=f"example:\n  {PROG} ui --run-dir demo-run --port 5000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--run-dir", default="demo-run", help="the run directory (default demo-run)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("MLFLOW_PORT", 5000)))
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    if not (run_dir / "mlflow.db").is_file():
        print(f"--run-dir {args.run_dir}: no mlflow.db in {run_dir}; pass the run directory "
              "of a run that used the default tracking store", file=sys.stderr)  # fmt: skip
        return CONFIG
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    cmd = [mlflow, "server", "--workers", "1", "--host", args.host, "--port", str(args.port),
           "--backend-store-uri", f"sqlite:///{run_dir}/mlflow.db",
           "--artifacts-destination", str(run_dir / "mlartifacts")]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return OK


COMMANDS: dict[str, Command] = {
    "run": Command("run the loop: generate -> train -> benchmark -> serve, in rounds", _run),
    "preflight": Command("check a config in seconds, before Ray or MLflow start", _preflight),
    "compat": Command("does a drafter fit a target (or compare two drafters)", _compat),
    "plan": Command("the accept_len a drafter needs for a speed", _plan),
    "generate": Command("the generate stage alone: one round's shards", _generate),
    "train": Command("the train stage alone: a drafter from shards", _train),
    "serve": Command("serve a drafter (embedded, SGLang or vLLM) and block", _serving("serve")),
    "bench": Command("benchmark an OpenAI-compatible endpoint", _serving("bench")),
    "swap": Command("hot-swap the drafter of a running `serve`", _serving("swap")),
    "runtime-env": Command("the runtime env to `ray job submit` a run with", _env("runtime-env")),
    "node-env": Command("shell exports of a config's secrets, for the nodes", _env("node-env")),
    "ui": Command("the MLflow UI of a run directory", _ui),
    "pack": Command("what a run directory carries to another machine, as one tar", _pack),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("eagle-loop")
    except PackageNotFoundError:
        return "unknown (not installed: `make setup`)"


def parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code}  {what}" for code, what in TABLE.items())
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="Improve EAGLE-3 speculative-decoding drafters in a generate -> train -> "
        "benchmark -> serve loop on Ray.",
        epilog=f"example:\n  {PROG} run --config configs/smollm2-cpu.yaml\n\n"
        f"`{PROG} <command> --help` lists a command's flags.\n\nexit codes:\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", action="version", version=f"{PROG} {version()}")
    sub = ap.add_subparsers(dest="command", metavar="<command>", title="commands")
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=cmd.help, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    """The console script. A known error type becomes its exit code and its message, without a
    traceback; any other exception propagates (Python exits 1: FAILED)."""
    from pydantic import ValidationError

    from actors.config import ConfigError
    from pipeline.preflight import PreflightError
    from pipeline.state import RunDirBusy

    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        if not argv or argv[0] not in COMMANDS:
            parser().parse_args(argv)  # --help, --version or a usage error: exits
            parser().print_help(sys.stderr)  # no command
            return USAGE
        return COMMANDS[argv[0]].run(argv[1:]) or OK
    except SystemExit as e:  # argparse (0 for --help, 2 for usage) or a message
        if e.code is None or isinstance(e.code, int):
            return e.code or OK
        print(e.code, file=sys.stderr)
        return CONFIG  # what a command needs: a package, a network (serve/bench_prompts.py)
    except (ConfigError, PreflightError, ValidationError) as e:
        print(e, file=sys.stderr)
        return CONFIG
    except RunDirBusy as e:
        print(e, file=sys.stderr)
        return BUSY


if __name__ == "__main__":
    sys.exit(main())
