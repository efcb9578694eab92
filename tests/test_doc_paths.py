"""Every repository path the README and docs/ name exists: a page that cites a file outside the
repository, or one since moved or deleted, fails here with the page, the line and the path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray_free

ROOT = Path(__file__).resolve().parents[1]
# the repository's folders, and two that are never in it (a machine's shared/ and notes/)
TOP = ("actors", "benchmarks", "configs", "deploy", "docs", "drafters", "eagle3", "pipeline",
       "scripts", "serve", "tests", "shared", "notes")  # fmt: skip
# a path starts at one of the repository's folders, not inside another path (ray/serve/...)
PATH = re.compile(rf"(?<![\w./~-])(?:{'|'.join(TOP)})/[\w./-]*")
OUTSIDE = re.compile(r"(?<![\w.])/work/[\w./-]+")  # a machine's own folders, never a user's


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks" / "reports").glob("*.md"))]  # fmt: skip


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of each repository-relative path in a page, trailing punctuation off."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            out.append((n, m.group(0).rstrip(".,:;")))
        out += [(n, m.group(0)) for m in OUTSIDE.finditer(line)]
    return out


def test_the_path_finder_reads_what_pages_write():
    text = "see `pipeline/run.py`, configs/smollm2-cpu.yaml; not ray/serve/_private/x.py or <run>/serve/x"
    assert [p for _, p in cited_paths(text)] == ["pipeline/run.py", "configs/smollm2-cpu.yaml"]
    outside = cited_paths("the card (shared/DESIGN.md, /work/notes/x)")
    assert [p for _, p in outside] == ["shared/DESIGN.md", "/work/notes/x"]


def test_every_path_the_docs_name_exists():
    found, missing = 0, []
    for page in pages():
        for line, path in cited_paths(page.read_text()):
            found += 1
            if path.startswith("/") or not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}:{line}: {path}")
    assert found > 100, found  # the pages were read
    assert not missing, "paths that are not in the repository:\n" + "\n".join(missing)
