"""One rule, one place: every stage that checks aux layer ids or a drafter against a target
gives the verdict of eagle3.fit, and every stage resolves a target path the same way.

Regression tests for the divergences of issue 15: `[1, 5]` passed the HF data stage and was refused
by SGLang; the engine accepted `[1, 14, 29]` for a 30-layer target, which the data stage refused;
the engine ignored a drafter of another width; a `.gguf` path resolved differently per stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip

from actors.config import TargetConfig
from actors.hf_backend import resolve_aux_layer_ids as hf_resolve
from actors.hf_backend import resolve_model
from actors.sglang_backend import resolve_layer_ids as sglang_resolve
from eagle3.config import Eagle3Config
from eagle3.fit import (
    aux_layer_problem,
    bad_aux_ids,
    drafter_fit_problems,
    resolve_capture_layers,
)
from eagle3.target_weights import resolve_target
from pipeline.config import parse_config
from serve.engine import _check_aux_ids, check_drafter_for_target

# no Ray, unmarked: `make test` runs it in the first pytest, which ends sooner (scripts/test_suite.py)

N = 30  # SmolLM2-135M's depth: valid ids 0..28
CASES = {
    (1, 5): False,  # two ids: fc needs three
    (1, 14, 29): False,  # 29 = the last layer's output, never captured
    (-1, 14, 26): False,
    (1, 14, 26): True,  # SGLang's default for 30 layers
    (0, 0, 28): True,
}


def _drafter(ids: list[int], hidden: int = 64, vocab: int = 1000) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=vocab, draft_vocab_size=100, target_hidden_size=hidden,
        aux_layer_ids=ids,
    )  # fmt: skip


def _accepts(fn, *args) -> bool:
    try:
        fn(*args)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("ids", list(CASES))
def test_every_stage_applies_the_same_aux_rule(ids):
    ids, ok = list(ids), CASES[ids]
    assert (aux_layer_problem(ids, N) is None) is ok
    verdicts = {
        "hf data stage": _accepts(hf_resolve, ids, N),
        "sglang data stage": _accepts(sglang_resolve, ids, N),
        "engine drafter check": not check_drafter_for_target(_drafter(ids), 1000, 64, N, "d"),
        "drafter fit": not drafter_fit_problems(
            _drafter(ids), vocab_size=1000, hidden_size=64, num_layers=N
        ),
    }
    assert verdicts == dict.fromkeys(verdicts, ok), ids
    # Runners and backends capture any layer list (the count is the drafter's rule), same range.
    assert _accepts(_check_aux_ids, ids, N) == (not bad_aux_ids(ids, N))
    assert _accepts(resolve_capture_layers, ids, N) == (not bad_aux_ids(ids, N))


def test_engine_refuses_a_drafter_of_another_width():
    """The engine's check had no hidden_size row; the training check did."""
    problems = check_drafter_for_target(_drafter([1, 14, 26], hidden=32), 1000, 64, N, "d")
    assert any("hidden_size 32 != target hidden 64" in p for p in problems), problems
    assert all(p.startswith("d: ") for p in problems)


def _local_target(tmp_path: Path, layers: int) -> Path:
    """A target folder with only a config.json: the check must not need weights."""
    d = tmp_path / f"t{layers}"
    d.mkdir()
    cfg = {"num_hidden_layers": layers, "hidden_size": 64, "vocab_size": 1000}
    (d / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 4}))
    return d


def test_bad_aux_ids_refused_before_any_model_loads(tmp_path):
    """Preflight (what run.py and the loop call before Ray starts) applies the same rule against
    the layer count in the target's config.json; the folder has no weights to load."""
    from pipeline.preflight import PreflightError, preflight

    target = str(_local_target(tmp_path, 4))
    preflight(parse_config({"target": {"model": target, "aux_layer_ids": [0, 1, 2]}}))
    for ids, words in (([0, 1, 3], r"\[0, 1, 3\] invalid for a 4-layer"), ([1, 2], "2 given")):
        with pytest.raises(PreflightError, match=rf"target.aux_layer_ids: .*{words}"):
            preflight(parse_config({"target": {"model": target, "aux_layer_ids": ids}}))


def test_one_resolver_for_a_gguf_path(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    expected = (str(tmp_path), "m.gguf")
    assert resolve_target(str(gguf)) == expected
    assert resolve_model(TargetConfig(model=str(gguf))) == expected
    assert resolve_model(TargetConfig(model="org/name", gguf_file="f.gguf")) == (
        "org/name",
        "f.gguf",
    )
