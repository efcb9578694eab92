"""docs/benchmarks.md and the README's results table are generated from benchmarks/results/*.json
(pipeline/results_docs.py) and are current: a record added or changed without regenerating both
fails here, as does a record missing a field."""

from __future__ import annotations

import json

import pytest

from pipeline.results_docs import (
    BEGIN,
    DEMO_BEGIN,
    DEMO_END,
    END,
    PAGE,
    README,
    demo_block,
    load,
    quickstart_block,
    readme_page,
    render,
    with_table,
)

pytestmark = pytest.mark.ray_free


def test_the_benchmarks_page_is_current():
    assert PAGE.read_text() == render(load()), (
        f"{PAGE} is stale: run `python -m pipeline.results_docs` and commit it"
    )


def test_the_readme_results_table_and_demo_output_are_current():
    readme = README.read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1
    assert readme.count(DEMO_BEGIN) == 1 and readme.count(DEMO_END) == 1
    assert readme == readme_page(readme, load()), (
        "README.md's generated blocks are stale: run `python -m pipeline.results_docs` and commit it"
    )


def test_the_readme_shows_the_demo_as_the_newest_record_printed_it():
    """The demo's table in the README is a record's `console` (what the run printed), never a
    table typed in: a record with other figures changes the README."""
    records = load()
    newest = next(r for r in records if r.get("readme_demo") and r["status"] == "current")
    block = demo_block(records)
    assert all(line in block for line in newest["console"]) and newest["commit"] in block
    changed = [{**newest, "console": [*newest["console"][:-1], "round 9 was never run"]}]
    assert "round 9 was never run" in demo_block(changed + records)
    assert with_table(README.read_text(), block, DEMO_BEGIN, DEMO_END) == README.read_text()


def test_the_readme_quickstart_times_are_a_clean_clones_measured_ones():
    """Issue 58: `make setup` and `make test` in the README are the times of a record of a clean
    clone's CI command, `make demo` the demo record's runs: a record with other times changes
    the README, and none is typed in."""
    records = load()
    q = next(r for r in records if r.get("readme_quickstart") and r["status"] == "current")
    block = quickstart_block(records)
    assert q["commit"] in block and q["date"] in block
    slower = [{**q, "figures": [{**f, "value": f["value"] * 3} if f.get("key") == "test" else f
                                for f in q["figures"]]}]  # fmt: skip
    assert quickstart_block(slower + records) != block
    assert block in README.read_text()


def test_every_record_says_where_when_what_and_how():
    records = load()
    assert len(records) >= 10
    for r in records:
        assert r["hardware"] and r["date"] and r["commit"] and r["command"] and r["versions"], r
        if r["status"] == "historical":
            assert r.get("note"), f"{r['file']}: a historical record says what changed since"
        if r["kind"] == "loop":
            assert r["rounds"] and all("accept_len" in x and "shape" in x for x in r["rounds"])
            assert r["scenario"] in PAGE.read_text()
    current = [r for r in records if r["kind"] == "loop" and r["status"] == "current"]
    assert all(r["scenario"] in README.read_text() for r in current)


def test_a_record_without_its_commit_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"scenario": "s", "kind": "loop"}))
    with pytest.raises(ValueError, match="commit"):
        load(tmp_path)
