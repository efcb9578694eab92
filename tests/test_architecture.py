"""Import boundaries: the parts the driver composes never import the driver, and the drafter
library stays free of Ray, MLflow and serving code. The project's modules stand on five floors,
benchmarks -> pipeline -> serve -> actors -> eagle3: a module imports only from its own floor or
below, and no two modules import each other, directly or round a longer circle. Every import
counts, lazy ones inside functions and `if TYPE_CHECKING:` blocks included; a failure names the
file, line and module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("eagle3", "actors", "serve", "pipeline")
FLOORS = ("eagle3", "actors", "serve", "pipeline", "benchmarks")  # bottom to top
SERVING = ("serve", "fastapi", "starlette", "uvicorn", "httpx", "sglang", "vllm")
# package -> top-level modules it must never import besides the floors above it
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "eagle3": ("ray", "mlflow", *SERVING),
    "actors": ("mlflow",),
    "serve": ("mlflow",),
    "pipeline": (),
}
MLFLOW_HOME = "pipeline/tracking.py"  # the one module that talks to MLflow
MAX_LINES = 700  # a module past this holds more than one role: split it


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dotted module) of every import statement in a file; relative imports resolved
    against the file's package."""
    return [(line, mod) for line, mod, _ in _imports(path, root)]


def _imports(path: Path, root: Path) -> list[tuple[int, str, list[str]]]:
    """(line, dotted module, names taken by `from module import ...`) of every import."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = path.relative_to(root).parent.parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.append((node.lineno, base, [a.name for a in node.names]))
    return out


def violations(files: list[Path], root: Path = ROOT) -> list[str]:
    bad = []
    for f in files:
        rel = f.relative_to(root)
        pkg = rel.parts[0]
        banned = (*FLOORS[FLOORS.index(pkg) + 1 :], *FORBIDDEN[pkg])
        for line, mod in imported_modules(f, root):
            top = mod.split(".")[0]
            if top in banned or (top == "mlflow" and rel.as_posix() != MLFLOW_HOME):
                bad.append(f"{rel}:{line} imports {mod} ({rel.parts[0]}/ must not import {top})")
    return bad


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line}. `from a import b` points at a.b where
    that is a module, else at a; lazy imports count."""
    names = {module_name(f, root): f for f in files}
    graph: dict[str, dict[str, int]] = {}
    for name, f in names.items():
        edges = graph.setdefault(name, {})
        for line, mod, taken in _imports(f, root):
            for target in [m for t in taken if (m := f"{mod}.{t}") in names] or [mod]:
                if target in names and target != name:
                    edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: each strongly connected set of two or more modules, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _sources() -> list[Path]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 30, files  # the walk found the packages
    return files


def test_no_forbidden_imports():
    bad = violations(_sources())
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_the_check_names_file_and_line(tmp_path):
    """The check itself can fail: planted lazy imports are reported with their place."""
    fake = tmp_path / "eagle3" / "x.py"
    fake.parent.mkdir()
    fake.write_text(
        "import torch\n\n\ndef f():\n    from pipeline.config import Config\n    import ray\n"
    )
    rel = tmp_path / "actors" / "y.py"
    rel.parent.mkdir()
    rel.write_text("from ..pipeline import loop\nfrom . import chat\n")
    assert violations([fake, rel], tmp_path) == [
        "eagle3/x.py:5 imports pipeline.config (eagle3/ must not import pipeline)",
        "eagle3/x.py:6 imports ray (eagle3/ must not import ray)",
        "actors/y.py:1 imports pipeline (actors/ must not import pipeline)",
    ]


def _cycle_text(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    inside = set(cycle)
    return "; ".join(
        f"{a} -> {b} (line {line})" for a in cycle for b, line in graph[a].items() if b in inside
    )


def test_no_import_cycles():
    """No module reaches itself through imports, lazy ones included (floors: benchmarks too)."""
    files = sorted(p for pkg in FLOORS for p in (ROOT / pkg).rglob("*.py"))
    graph = import_graph(files)
    assert {"benchmarks.engine_shapes", "actors.prompts", "eagle3.train_step"} <= graph.keys()
    assert "actors.sources" in graph["actors.prompts"]  # a lazy `from x import y` is an edge
    bad = cycles(graph)
    assert not bad, "import circles:\n" + "\n".join(_cycle_text(graph, c) for c in bad)


def test_the_cycle_check_finds_planted_circles(tmp_path):
    """A two-module circle through a function-level import, a three-module one through
    `from pkg import module`, and a relative import are found; an acyclic chain is not."""
    files = {
        "actors/a.py": "def f():\n    from actors.b import x\n",
        "actors/b.py": "from . import a\nx = 1\n",
        "serve/c.py": "from serve import d\n",
        "serve/d.py": "import serve.e\n",
        "serve/e.py": "def g():\n    import serve.c\n",
        "eagle3/f.py": "from actors import a\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(sorted(tmp_path.rglob("*.py")), tmp_path)
    assert cycles(graph) == [["actors.a", "actors.b"], ["serve.c", "serve.d", "serve.e"]]


def bypassing_the_harness(files: list[Path], root: Path = ROOT) -> list[str]:
    """Benchmark scripts that print results themselves instead of through benchmarks/harness.py
    (one JSON line with the environment, kept under $OUT): no harness import, or a
    `print(json.dumps(...))` of their own."""
    bad = []
    for f in files:
        text = f.read_text()
        if '__name__ == "__main__"' not in text:
            continue  # a module the scripts import, not a script
        rel = f.relative_to(root).as_posix()
        if "benchmarks.harness" not in {m for _, m in imported_modules(f, root)}:
            bad.append(f"{rel}: does not import benchmarks.harness")
        if "print(json.dumps(" in text:
            bad.append(f"{rel}: prints JSON itself (use harness.Results)")
    return bad


def test_benchmarks_print_through_the_harness():
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) > 10, scripts
    bad = bypassing_the_harness(scripts)
    assert not bad, "\n".join(bad)


def _calls(files: list[Path], dotted: str) -> list[str]:
    """`file:line` of every call of `dotted` (e.g. `os.replace`) in `files`."""
    obj, attr = dotted.rsplit(".", 1)
    out = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            fn = getattr(node, "func", None)
            if (
                isinstance(node, ast.Call)
                and isinstance(fn, ast.Attribute)
                and fn.attr == attr
                and isinstance(fn.value, ast.Name)
                and fn.value.id == obj
            ):
                out.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    return out


def _classes(files: list[Path], name: str) -> list[str]:
    return [
        f"{f.relative_to(ROOT)}:{node.lineno}"
        for f in files
        for node in ast.walk(ast.parse(f.read_text(), str(f)))
        if isinstance(node, ast.ClassDef) and node.name == name
    ]


def test_one_of_each_shared_helper():
    """One atomic write (actors/files.py), one Ray start-up (actors/cluster.py), one TargetInfo
    (eagle3/target_weights.py), one aux-layer rule (eagle3/fit.py): a second copy fails here."""
    files = _sources()
    assert [c.split(":")[0] for c in _calls(files, "os.replace")] == ["actors/files.py"], (
        "use actors.files.atomic_write"
    )
    assert {c.split(":")[0] for c in _calls(files, "ray.init")} == {"actors/cluster.py"}, (
        "use actors.cluster.start_ray"
    )
    assert [c.split(":")[0] for c in _classes(files, "TargetInfo")] == ["eagle3/target_weights.py"]
    own_set = [f"{f.relative_to(ROOT)}" for f in files if '"--set"' in f.read_text()]
    assert own_set == ["actors/config.py"], f"use actors.config.add_set_argument: {own_set}"
    rule = [
        f"{f.relative_to(ROOT)}"
        for f in files
        if "num_layers - 2" in f.read_text() and f.relative_to(ROOT).as_posix() != "eagle3/fit.py"
    ]
    assert not rule, f"the aux-layer range is written outside eagle3/fit.py: {rule}"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_module_over_the_line_limit(pkg):
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by role): {long}"


BARE_HOST_MISSING = ("ray", "mlflow", "fastapi", "pydantic")  # absent where only torch is


def _top_level_imports(path: Path) -> list[str]:
    """Modules a file imports when it is imported (module body only: no lazy or TYPE_CHECKING)."""
    body = ast.parse(path.read_text(), str(path)).body
    return [m for node in body for m in _top_level_imports_of(node)]


def _needs_more() -> set[str]:
    """Project modules whose import pulls in a package a bare GPU host lacks (transitively)."""
    mods = {}
    for p in _sources():
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        mods[name] = _top_level_imports(p)
    needs = set()
    changed = True
    while changed:
        changed = False
        for name, imports in mods.items():
            hit = any(
                m.split(".")[0] in BARE_HOST_MISSING or m in needs or m.rsplit(".", 1)[0] in needs
                for m in imports
            )
            if hit and name not in needs:
                needs.add(name)
                changed = True
    return needs


def test_test_modules_skip_on_a_bare_gpu_host():
    """`pytest -m gpu tests` must collect where only torch and transformers are installed: a test
    module importing (at top level) what needs Ray, MLflow, fastapi or pydantic first calls
    `pytest.importorskip`, so it is skipped there instead of stopping the collection."""
    needs = _needs_more()
    assert {"pipeline.config", "serve.deployment", "actors.target"} <= needs  # the walk works
    bad = []
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        guarded = False
        for node in ast.parse(f.read_text(), str(f)).body:
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
            if any(getattr(c.func, "attr", "") == "importorskip" for c in calls):
                guarded = True
            for m in _top_level_imports_of(node):
                if (m.split(".")[0] in BARE_HOST_MISSING or m in needs) and not guarded:
                    bad.append(
                        f"tests/{f.name}:{node.lineno} imports {m} before pytest.importorskip"
                    )
    assert not bad, "\n".join(bad)


def _top_level_imports_of(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module]
    return []
