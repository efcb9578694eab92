"""Everything about a run that can be checked without a model, checked before Ray starts and
before any MLflow run exists: paths, the target's config.json against the aux layer ids, the
starting drafter's fit, the prompt file. Seconds, not the minute a stage needs to fail.

  python -m pipeline.preflight --config configs/smollm2-cpu.yaml [--set a.b=v]

`preflight(cfg)` raises PreflightError listing every problem with its config field and fix.

A value that looks like a local path (starts with `.`, `/` or `~`, has more than one `/`, or is
`dir/name` where `dir` exists here or in this checkout) and does not exist is an error, never a Hub repo id: a
mistyped `runs/x/drafter` must not become a network request for repo `runs/x`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from actors.config import add_set_argument
from pipeline.config import Config, ConfigError, load_config
from pipeline.exit_codes import CONFIG, OK

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class PreflightError(ValueError):
    """Every problem found before the run starts, one line each: field, value, fix."""


def looks_local(value: str) -> bool:
    """A path on this machine, as opposed to an HF Hub repo id (`org/name` or `name`)."""
    if value.startswith((".", "/", "~")) or "\\" in value or not _HUB_ID.match(value):
        return True
    head, _, tail = value.partition("/")
    repo = Path(__file__).resolve().parent.parent  # shipped drafters: DrafterConfig.resolved_init
    return bool(tail) and (Path(head).is_dir() or (repo / head).is_dir())


def path_problem(field: str, value: str) -> str | None:
    """Why `value` (a local folder/file or a Hub id) cannot be used, or None."""
    p = Path(value).expanduser()
    if p.exists() or not looks_local(value):
        return None
    return (
        f"{field}: {value!r} looks like a local path but {p.resolve()} does not exist; fix the "
        "path (an HF Hub repo id is `org/name`)"
    )


def preflight(cfg: Config) -> None:
    """Raise PreflightError naming every problem; return quietly when the run can start."""
    problems = _target_problems(cfg) + _drafter_problems(cfg) + _prompt_problems(cfg)
    problems += _regime_problems()
    if problems:
        raise PreflightError(
            f"preflight: {len(problems)} problem(s), nothing was started:\n  "
            + "\n  ".join(problems)
        )


def _regime_problems() -> list[str]:
    """The CPU regime's switch (EAGLE_LOOP_CPU_BF16) holds a value it knows."""
    from eagle3.cpu import cpu_regime

    try:
        cpu_regime()
    except ValueError as e:
        return [str(e)]
    return []


def _target_problems(cfg: Config) -> list[str]:
    from actors.hf_backend import resolve_aux_layer_ids
    from eagle3.target_weights import SMOLLM2, read_target_info

    t = cfg.target
    if t.model != SMOLLM2 and (problem := path_problem("target.model", t.model)):
        return [problem]
    try:
        info = read_target_info(t.model, t.revision, t.gguf_file)
    except Exception as e:  # noqa: BLE001 - any reason the config cannot be read
        return [f"target.model: cannot read the config of {t.model!r} ({e}); check the path/id"]
    try:
        resolve_aux_layer_ids(t.aux_layer_ids, info.num_layers)
    except ValueError as e:
        return [str(e)]
    return []


def _drafter_problems(cfg: Config) -> list[str]:
    init = cfg.drafter.resolved_init()
    if init in ("scratch", "previous"):
        return []
    if problem := path_problem("drafter.init", init):
        if init.startswith("drafters/"):  # a shipped one, left out of a job's upload
            problem += (
                "; in a `ray job submit` job, make the runtime env with the job's own overrides "
                "(`eagle-loop runtime-env CONFIG --set ...`): it uploads only the drafter the "
                "resolved config starts from"
            )
        return [problem]
    from eagle3.target_weights import resolve_target
    from pipeline.compat import check_compat

    model, gguf = resolve_target(cfg.target.model, cfg.target.gguf_file)
    try:
        report = check_compat(init, model, target_revision=cfg.target.revision, gguf_file=gguf)
    except Exception as e:  # noqa: BLE001
        return [f"drafter.init: cannot read {init!r} ({e}); point it at an EAGLE-3 checkpoint"]
    return [
        f"drafter.init: {init!r} does not fit target.model {cfg.target.model!r}: {m['field']}: "
        f"drafter {m['left']!r} vs target {m['right']!r}"
        for m in report.mismatches
    ]


def _prompt_problems(cfg: Config) -> list[str]:
    from actors.prompts import load_prompts, plan_prompts, split_prompts

    d = cfg.data
    if d.source == "hf":  # a dataset name; a local-looking one must exist
        return [p] if d.path and (p := path_problem("data.path", d.path)) else []
    try:
        if "pool" in d.sources():  # the pool's split is the plan's own (a few seconds)
            plan_prompts(d, eval_files=cfg.bench.eval_files or [])
        else:
            split_prompts(load_prompts(d), d.heldout_prompts, d.seed)
    except (OSError, ValueError) as e:
        return [str(e)]
    return []


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.preflight") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=f"example:\n  {prog} --config configs/llama31-8b-1gpu.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True)
    add_set_argument(ap)
    args = ap.parse_args(argv)
    try:
        preflight(load_config(args.config, args.set))
    except (ConfigError, PreflightError) as e:
        print(e, file=sys.stderr)
        return CONFIG
    print("preflight: ok")
    return OK


if __name__ == "__main__":
    sys.exit(main())
