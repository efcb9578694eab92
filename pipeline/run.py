"""Entry point of the loop: `python pipeline/run.py --config configs/smollm2-cpu.yaml`
(`eagle-loop run`).

Submitted with `ray job submit --working-dir . -- python pipeline/run.py --config ...` it joins
the job's cluster (RAY_ADDRESS is set by Ray); run directly it starts a local Ray on loopback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

# Run as a script from the job's working dir: make that copy of the code the one imported.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.config import add_set_argument  # noqa: E402
from pipeline.config import Config, ConfigError, load_config  # noqa: E402
from pipeline.console import driver_console, final_report, log, ray_logs_dir  # noqa: E402
from pipeline.exit_codes import BUSY, CONFIG, FAILED, OK  # noqa: E402
from pipeline.layout import RunDir  # noqa: E402
from pipeline.preflight import PreflightError, preflight  # noqa: E402
from pipeline.state import RunDirBusy, hold_run_dir  # noqa: E402


def local_num_cpus(cfg: Config) -> int:
    """Logical CPUs of a Ray started here: the largest stage beside the embedded server (its
    `serve.num_replicas` replicas), which stays up across rounds while the next round's target actors and trainers run. With only the
    machine's cores (2 here) the second round's trainers would wait for the server's CPU forever.
    Ray's CPUs are bookkeeping: the stages share the cores, as `make demo`'s head does."""
    cores = os.cpu_count() or 1
    trainers = math.ceil(cfg.train.num_workers * cfg.train.cpus_per_worker)
    stage = max(cores, cfg.data.num_actors, trainers)  # an actor takes >= 1 CPU
    cpu_server = cfg.serve.num_gpus == 0
    server = math.ceil(cfg.serve.num_cpus * cfg.serve.num_replicas) if cpu_server else 0
    return stage + server


PROG = "python pipeline/run.py"
ENV_COMMANDS = ("runtime-env", "node-env")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """The loop (exit codes: pipeline/exit_codes.py); `runtime-env` or `node-env` first runs
    that command instead (`env_main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in ENV_COMMANDS:
        return env_main(argv, prog)
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  {prog} --config configs/smollm2-cpu.yaml --run-dir runs/demo\n\n"
        f"also: {prog} runtime-env CONFIG, {prog} node-env CONFIG (see `{prog} runtime-env "
        "--help`)",
    )
    ap.add_argument("--config", required=True, help="YAML config (see configs/)")
    ap.add_argument(
        "--run-dir", default=None, help="run directory (default runs/<name>); re-run to resume"
    )
    add_set_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return CONFIG
    run_dir = Path(args.run_dir or f"runs/{cfg.name}").resolve()
    try:
        preflight(cfg)  # seconds; before Ray starts and before any MLflow run exists
    except PreflightError as err:
        print(err, file=sys.stderr)
        return CONFIG
    # Every worker line Ray forwards, once each in the driver log: deduplication would fold an
    # actor's repeats into one line and a notice. Read when Ray is imported, after this.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        with hold_run_dir(run_dir), driver_console(run_dir):  # console: the stage lines only
            summary = _run(cfg, run_dir)
    except RunDirBusy as err:
        print(err, file=sys.stderr)
        return BUSY
    if summary is None:
        return FAILED
    print(final_report(summary))
    print(f"summary:  {RunDir(run_dir).summary}")
    return OK


def _run(cfg: Config, run_dir: Path) -> dict | None:
    """Ray, then the loop; None after an error whose message says what to do."""
    from actors.cluster import start_ray

    # inside `ray job submit` the job's runtime_env (see job_runtime_env) applies; a local Ray
    # started here gets the secrets through this process's environment, which it inherits
    from pipeline.console import regime_line

    log.info(regime_line(cfg))  # first: what every speed below depends on
    runtime_env, secrets = split_secrets(cfg.runtime_env)
    if not os.environ.get("RAY_ADDRESS"):
        os.environ.update(secrets)
    start_ray(runtime_env, num_cpus=local_num_cpus(cfg), join_with_runtime_env=False,
              host=cfg.ray_host)  # fmt: skip
    log.info("driver log: %s  (all else the driver prints: libraries, HTTP requests, MLflow, "
             "Serve, its Ray workers' output)", RunDir(run_dir).driver_log)  # fmt: skip
    log.info("Ray logs:   %s  (each worker's own files; Serve's access logs in serve/)",
             ray_logs_dir())  # fmt: skip

    from pipeline.budget import BudgetError
    from pipeline.loop import run_loop
    from pipeline.tracking import TrackingUnavailable, UnknownRuns
    from serve.endpoint import ServeClaimed

    try:
        return run_loop(cfg, run_dir)
    except (UnknownRuns, TrackingUnavailable, ServeClaimed) as err:
        log.error("%s", err)  # it says what to do; a traceback would bury it
    except BudgetError:  # the loop said it (run FAILED: ...), before any round
        pass
    return None


# Never uploaded with a job: local venvs, git (a worktree's .git is a file), bytecode, run outputs,
# and what scripts/gpu_host.sh carries onto a GPU host beside the checkout. It holds Ray's own
# default excludes too, which scripts/demo.sh turns off (Ray warns about each of them it finds).
UPLOAD_EXCLUDES = [".venv/", ".venv-vllm/", "venv/", ".git", "__pycache__/", "runs/", "demo-run/",
                   "*.db", "mlartifacts/", ".carry/", ".whl/", ".gl/"]  # fmt: skip


def split_secrets(runtime_env: dict) -> tuple[dict, dict[str, str]]:
    """(runtime_env without its secret env vars, those vars: tokens, passwords, keys, by
    actors/redact.py's rule). Ray puts a job's env_vars on its workers' command lines, where
    `ps` shows them, and logs them at info in runtime_env_agent.log (both seen with a planted
    HF_TOKEN); secrets reach workers through the nodes' environment instead, which Ray's
    processes inherit from `ray start` (scripts/demo.sh: `node-env` below)."""
    from actors.redact import is_secret

    vars_ = dict(runtime_env.get("env_vars") or {})
    secrets = {k: str(v) for k, v in vars_.items() if is_secret(k)}
    env = {**runtime_env, "env_vars": {k: v for k, v in vars_.items() if k not in secrets}}
    return env, secrets


def unused_drafters(cfg: Config, working_dir: str = ".") -> list[str]:
    """The shipped drafters (`drafters/*/`, 18.8 MiB each, over Ray's 10 MiB upload warning) that
    the config does not start from, as upload excludes: the job uploads only the one
    `drafter.init` names, and none when it starts from scratch or a Hub repo id."""
    root = Path(working_dir) / "drafters"
    if not root.is_dir():
        return []
    init = Path(cfg.drafter.init).expanduser()
    used = (init if init.is_absolute() else Path(working_dir) / init).resolve()
    return [f"drafters/{d.name}/" for d in sorted(root.iterdir())
            if d.is_dir() and d.resolve() != used]  # fmt: skip


def job_runtime_env(
    config: str, working_dir: str = ".", overrides: list[str] | None = None
) -> dict:
    """The runtime_env to submit a job with: the config's own plus the working dir, without the
    local virtualenv, run outputs and the shipped drafters it does not start from (they must not
    be uploaded), and without secret env vars (`split_secrets`: give them to the cluster's
    nodes). `overrides` are the job's own `--set` values: the config the job resolves decides
    what travels, so a `--set drafter.init=drafters/...` uploads that drafter."""
    cfg = load_config(config, overrides)
    env, _ = split_secrets(dict(cfg.runtime_env))
    env.setdefault("working_dir", working_dir)
    env.setdefault("excludes", UPLOAD_EXCLUDES + unused_drafters(cfg, working_dir))
    vars_ = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **dict(env.get("env_vars") or {})}
    # vLLM's own venv is not uploaded: the job's actors find it by absolute path
    # (actors/vllm_server.py `vllm_python`)
    vllm_py = Path(working_dir, ".venv-vllm", "bin", "python").absolute()
    if vllm_py.is_file():
        vars_.setdefault("EAGLE_LOOP_VLLM_PYTHON", str(vllm_py))
    env["env_vars"] = vars_
    return env


def env_main(argv: list[str], prog: str = PROG) -> int:
    """`runtime-env CONFIG`: the job's runtime env as JSON (scripts/demo.sh: `ray job submit
    --runtime-env`); `node-env CONFIG`: shell exports of the config's secret env vars, for the
    nodes' environment before `ray start`."""
    ap = argparse.ArgumentParser(prog=prog, description="The runtime env of a Ray job, and the "
                                 "secrets it leaves to the nodes.")  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_, example in (
        ("runtime-env", "print the job's runtime_env as JSON (secret env vars left out)",
         "runtime-env configs/smollm2-cpu.yaml --set drafter.init=drafters/smollm2-135m-base "
         "> runtime-env.json   # the job's own --set values"),
        ("node-env", "print `export K=V` lines of the config's secret env vars",
         "node-env configs/smollm2-cpu.yaml > secrets.sh   # then `source secrets.sh`, `ray start`"),
    ):  # fmt: skip
        p = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {prog} "
                           f"{example}", formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        p.add_argument("config", help="YAML config (see configs/)")
        add_set_argument(p)  # the same overrides as the job's, or the upload misses a drafter
        if name == "runtime-env":
            p.add_argument("--working-dir", default=".", help="the job's working dir (default .)")
    args = ap.parse_args(argv)
    try:
        secrets = split_secrets(load_config(args.config, args.set).runtime_env)[1]
        if args.cmd == "runtime-env":
            print(json.dumps(job_runtime_env(args.config, args.working_dir, args.set)))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return CONFIG
    if args.cmd == "node-env":
        import shlex

        for k, v in secrets.items():
            print(f"export {k}={shlex.quote(v)}")
    elif secrets:
        print(f"runtime_env.env_vars: {', '.join(sorted(secrets))} left out of the job's runtime "
              "env (Ray would show them in `ps` and its logs); give them to the nodes' "
              f"environment: `source <({prog} node-env CONFIG)` before `ray start`",
              file=sys.stderr)  # fmt: skip
    return OK


if __name__ == "__main__":
    sys.exit(main())
