"""The workshop's rules (docs/design.md, the layout): what sits beside the packages -- benchmarks/, soaks/,
examples/, scripts/ and the top-level bench_session_responsiveness.py -- imports nothing from tests/ and never edits
sys.path, and a benchmark imports what it shares from benchmarks.benchlib, never from another benchmark. Read from
each file's syntax tree, so a rule broken in a function body (an import deferred to run time) counts too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("benchmarks", "soaks", "examples", "scripts")
TOP_LEVEL = ("bench_session_responsiveness.py",)
TEST_MODULES = {"tests", "support", "conftest"}  # tests/support is imported as `support` by the suite
BENCHMARKS_SHARED = {"benchmarks", "benchmarks.benchlib"}  # what a benchmark may import from its own folder
PATH_EDITS = {"insert", "append", "extend", "remove", "clear", "pop"}


def workshop_files(root: Path) -> Iterator[Path]:
    for folder in FOLDERS:
        yield from sorted((root / folder).rglob("*.py"))
    for name in TOP_LEVEL:
        if (root / name).exists():
            yield root / name


def imported_modules(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            if node.module in FOLDERS:  # `from benchmarks import bench_b` imports the module benchmarks.bench_b
                yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def edits_sys_path(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PATH_EDITS
                and _is_sys_path(node.func.value)):
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        if any(_is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)) for t in targets):
            return True
    return False


def violations(root: Path) -> list[str]:
    """Every broken rule under `root`, one line each."""
    found = []
    for path in workshop_files(root):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        modules = set(imported_modules(tree))
        for module in sorted(modules):
            top = module.split(".")[0]
            if top in TEST_MODULES:
                found.append(f"{rel} imports {module} from tests/")
            if top == "bench_session_responsiveness":
                found.append(f"{rel} imports the top-level benchmark {module}")
            if rel.startswith("benchmarks/") and top == "benchmarks" and module not in BENCHMARKS_SHARED:
                found.append(f"{rel} imports another benchmark, {module}")
        if edits_sys_path(tree):
            found.append(f"{rel} edits sys.path")
    return found


def test_the_workshop_imports_nothing_from_tests_and_no_benchmark_imports_another() -> None:
    assert list(workshop_files(ROOT)), "no workshop files found: the layout moved without this test"
    assert violations(ROOT) == []


def test_the_rules_are_read_from_the_syntax_tree(tmp_path: Path) -> None:
    """Each rule catches its breach, including one deferred into a function body."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "benchmarks" / "bench_a.py").write_text(
        "from benchmarks.benchlib import pct\nfrom benchmarks import bench_b\n"
        "from bench_session_responsiveness import HealthPoller\n")
    (tmp_path / "scripts" / "tool.py").write_text(
        "import sys\n\ndef f():\n    sys.path.insert(0, 'tests')\n    from support.tito import generate\n")
    (tmp_path / "scripts" / "clean.py").write_text("import sys\nprint(sys.path[0])\nfrom benchmarks import benchlib\n")
    assert violations(tmp_path) == [
        "benchmarks/bench_a.py imports the top-level benchmark bench_session_responsiveness",
        "benchmarks/bench_a.py imports another benchmark, benchmarks.bench_b",
        "scripts/tool.py imports support.tito from tests/",
        "scripts/tool.py edits sys.path",
    ]
