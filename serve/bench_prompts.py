"""The benchmark CLI's prompts when none are given: the loop's own held-out split of real prompts
(actors/prompts.py `plan_prompts`: per source `data.heldout_prompts`, never trained on,
interleaved by domain), or `bench.eval_files` where the config names them, as the loop judges each
round. Not the built-in generated set, whose templated prompts overstate acceptance. And what a
standard `--suite` needs, said before anything is loaded.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def heldout_prompts(
    config: str | None,
    overrides: list[str] | None = None,
    *,
    heldout: int | None = None,
    seed: int | None = None,
) -> tuple[list[Any], list[str]]:
    """(conversations, domain of each): `config`'s bench.eval_files, else the held-out split of
    its data section's sources (without a config: data.source `real`); `heldout` and `seed`
    replace data.heldout_prompts and data.seed."""
    from actors.config import DataConfig, read_yaml
    from actors.prompts import interleave, load_jsonl_prompts, plan_prompts
    from serve.config import BenchConfig

    raw = read_yaml(config, overrides) if config else {}
    data = dict(raw.get("data") or {})
    data.update({k: v for k, v in (("heldout_prompts", heldout), ("seed", seed)) if v is not None})
    eval_files = BenchConfig.model_validate(raw.get("bench") or {}).eval_files
    if eval_files:
        prompts = interleave([load_jsonl_prompts(Path(f)) for f in eval_files])
        what = f"bench.eval_files of {config}"
    else:
        prompts = plan_prompts(DataConfig.model_validate(data)).heldout
        what = f"the held-out split of {config or 'data.source real'}"
    domains = sorted({p.domain for p in prompts})
    print(f"bench: {len(prompts)} prompts, {what} ({', '.join(domains)})", file=sys.stderr)
    return [p.messages for p in prompts], [p.domain for p in prompts]


def check_suites(names: list[str]) -> None:
    """Exit with what `--suite` needs (the `datasets` package, then a network to the Hugging
    Face Hub) before any prompt is read."""
    if names and importlib.util.find_spec("datasets") is None:
        raise SystemExit(
            f"--suite {', '.join(names)}: needs the `datasets` package (`pip install datasets`) "
            "and a network to the Hugging Face Hub, where each suite is downloaded from; or pass "
            "your own prompts with --prompts-jsonl"
        )


def suite_load_error(name: str, repo: str, err: BaseException) -> str:
    return (
        f"--suite {name}: could not load {repo} from the Hugging Face Hub ({type(err).__name__}: "
        f"{err}); it needs a network to huggingface.co (HF_HUB_OFFLINE unset) or the dataset in "
        "the local HF cache; or pass your own prompts with --prompts-jsonl"
    )
