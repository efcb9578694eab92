"""Every repository path the README and docs/ name exists: a page that cites a file outside the
repository, or one since moved or deleted, fails here with the page, the line and the path. A
file the tree no longer has may be named where the page also says which commit keeps it
(`COMMIT:path`, as `git show` takes it). And benchmarks/ holds at most 15 scripts, each on its
page (benchmarks/NOTES.md) with its question and command."""

from __future__ import annotations

import re
import subprocess
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
# a file git keeps at a commit: `fe7e65b:benchmarks/gpu_train.py`
IN_GIT = re.compile(rf"(?<![\w./-])([0-9a-f]{{7,40}}):((?:{'|'.join(TOP)})/[\w./-]*)")
SCRIPTS_PAGE = ROOT / "benchmarks" / "NOTES.md"
MOST_SCRIPTS = 15  # one script per question still asked (issue 58)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), SCRIPTS_PAGE,
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


def kept_in_git(text: str) -> list[tuple[str, str]]:
    """(commit, path) of each `COMMIT:path` a page names, trailing punctuation off."""
    return [(c, p.rstrip(".,:;")) for c, p in IN_GIT.findall(text)]


def git_has(commit: str, path: str) -> bool:
    """Whether `commit` holds `path`; true where this checkout cannot tell (no git, or a shallow
    clone without that commit)."""

    def ok(spec: str) -> bool:
        return subprocess.run(["git", "cat-file", "-e", spec], cwd=ROOT, capture_output=True).returncode == 0  # fmt: skip

    try:
        return not ok(f"{commit}^{{commit}}") or ok(f"{commit}:{path}")
    except OSError:
        return True


def test_the_path_finder_reads_where_git_keeps_a_file():
    text = "removed after fe7e65b (`git show fe7e65b:benchmarks/gpu_train.py`); not abc:docs/x.md"
    assert kept_in_git(text) == [("fe7e65b", "benchmarks/gpu_train.py")]
    assert "benchmarks/gpu_train.py" in [p for _, p in cited_paths(text)]


def test_every_path_the_docs_name_exists():
    found, missing = 0, []
    for page in pages():
        text = page.read_text()
        kept = kept_in_git(text)
        missing += [f"{page.relative_to(ROOT)}: {c}:{p} (not in git)" for c, p in kept
                    if not git_has(c, p)]  # fmt: skip
        for line, path in cited_paths(text):
            found += 1
            gone = path.startswith("/") or not (ROOT / path).exists()
            if gone and path not in {p for _, p in kept}:
                missing.append(f"{page.relative_to(ROOT)}:{line}: {path}")
    assert found > 100, found  # the pages were read
    assert not missing, "paths that are not in the repository:\n" + "\n".join(missing)


def test_benchmarks_holds_at_most_15_scripts_each_on_its_page():
    """benchmarks/ keeps one script per question still asked, at most 15 files, and its page
    gives each a row (`| `NAME.py` | question | command | reported in |`) whose command runs it
    (a module without `__main__`, imported by the scripts, has none); a row for a file the folder
    lacks fails too. A finished study's script leaves for git history, its report stays."""
    rows = {m[1]: m[0] for m in re.finditer(r"(?m)^\| `(\w+\.py)` \|.*$", SCRIPTS_PAGE.read_text())}
    files = {p.name: p.read_text() for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    assert len(files) <= MOST_SCRIPTS, f"{len(files)} files in benchmarks/, at most {MOST_SCRIPTS}"
    assert sorted(rows) == sorted(files), "rows of benchmarks/NOTES.md against benchmarks/*.py"
    no_command = [name for name, src in files.items()
                  if '__name__ == "__main__"' in src and f"benchmarks/{name}" not in rows[name]]  # fmt: skip
    assert not no_command, f"rows without a command that runs the script: {no_command}"
