"""The import graph is the architecture (docs/design.md 2): checked from the source, so a shortcut cannot creep in.

Every import counts, including those under `if TYPE_CHECKING:` and inside functions: a cycle hidden from the
interpreter is still a cycle for the reader. Inside `session_server`, imports point one way, down the layers below
(front ends -> turn -> sessions -> engine); `trajectory` is pure; the emulated engine and the trainer's side are
their own packages. `rollout`, what a trainer installs, stands on `trajectory` alone; the loopback harness that
launches processes (`harness`) stands beside it and nothing the product ships imports it.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("session_server", "trajectory", "rollout", "sglang_sim", "deploy", "harness")

# session_server, bottom to top. A module may import from its own group and from lower layers only.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("metrics", "cpu_pool", "repeated_first_turns", "http", "tracing"),
    ("engine",),
    ("sessions",),
    ("config",),
    ("state",),
    ("turns",),
    ("frontend",),  # what the three front ends share: the chat-shaped turn request, reply facts, root sessions
    ("chat", "responses", "messages"),  # the front ends, one per API; none imports another
    ("api",),
    ("view",),  # the read-only trajectory viewer (its page and document: trajectory.view)
    ("app",),
    ("cli", ""),  # "" is the package's own __init__
]
RANK = {group: rank for rank, groups in enumerate(LAYERS) for group in groups}


def modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


@functools.cache
def imports(name: str, path: Path) -> tuple[str, ...]:
    """Every module `name` imports (absolute names), wherever the import statement stands; each file is parsed once
    per test process, however many checks read it."""
    return tuple(_imports(name, path))


def _imports(name: str, path: Path) -> Iterator[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def graph(package: str) -> dict[str, set[str]]:
    known = {m for p in FIRST_PARTY for m in modules(p)}
    return {
        name: {t for t in imports(name, path) if t in known and t != name} for name, path in modules(package).items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("package", FIRST_PARTY)
def test_no_import_cycles(package: str) -> None:
    assert cycles(graph(package)) == []


def test_session_server_imports_point_down_the_layers() -> None:
    edges = graph("session_server")
    unranked = sorted({group(m) for m in edges} - set(RANK))
    assert unranked == [], f"place these in LAYERS: {unranked}"
    upward = [
        f"{a} -> {b}"
        for a, targets in edges.items() for b in targets
        if b.startswith("session_server") and group(a) != group(b) and RANK[group(a)] <= RANK[group(b)]
    ]
    assert upward == []


def test_engine_code_never_sees_the_session_record() -> None:
    engine = {m: t for m, t in graph("session_server").items() if group(m) == "engine"}
    assert {m: sorted(t) for m, t in engine.items() if any(group(x) == "sessions" for x in t)} == {}


def repository_names() -> set[str]:
    """Every top-level name an import can reach in this repository: its packages and modules, and the test tree
    (tests/support is imported as `support`)."""
    names = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in ROOT.glob("*.py")}
    return names | {"tests", "support", "conftest"}


def test_every_folder_an_import_can_reach_is_known() -> None:
    """The rules below see an import of the harness, deploy/, a benchmark or the tests' support."""
    assert {*FIRST_PARTY, "benchmarks", "soaks", "examples", "scripts", "support"} <= repository_names()


@pytest.mark.parametrize("package, allowed", [
    ("trajectory", set()),
    ("sglang_sim", {"trajectory"}),
    ("session_server", {"trajectory"}),
    ("rollout", {"trajectory"}),  # the trainer's package: no launcher, no emulated engine, no deploy/
    ("deploy", {"session_server"}),
    ("harness", {"deploy", "sglang_sim", "rollout", "trajectory"}),
])
def test_packages_import_only_what_they_stand_on(package: str, allowed: set[str]) -> None:
    def ok(target: str) -> bool:
        return (target.split(".")[0] in (package, *allowed) or target in allowed
                or any(a.startswith(target + ".") for a in allowed))  # the package that holds an allowed module

    local = repository_names()
    foreign = {
        f"{m} -> {t}"
        for m, path in modules(package).items() for t in imports(m, path)
        if t.split(".")[0] in local and not ok(t)
    }
    assert foreign == set()


@pytest.mark.parametrize("package", ["session_server", "trajectory", "rollout", "sglang_sim", "deploy"])
def test_nothing_the_product_ships_imports_the_harness(package: str) -> None:
    found = {f"{m} -> {t}" for m, path in modules(package).items() for t in imports(m, path)
             if t.split(".")[0] == "harness"}
    assert found == set()


# Locks are fine (the pool threads share the families' caches); an event loop, sockets or files are not.
PURE_FORBIDDEN = ("asyncio", "httpx", "starlette", "uvicorn", "socket", "sqlite3", "concurrent", "subprocess")


def test_trajectory_is_pure() -> None:
    """No I/O and no event loop in the core: everything it does is a function of its arguments."""
    found = {
        f"{name} imports {target}"
        for name, path in modules("trajectory").items() for target in imports(name, path)
        if target.split(".")[0] in PURE_FORBIDDEN
    }
    assert found == set()


# Unit tests mirror the modules they test: tests/unit/<package path>/test_<module>.py (importlib import mode, so no
# basename need be unique). A test of a concern that spans modules is named here; a new unit test module either
# names the module it tests or joins this list on purpose.
CONCERN_TESTS = {
    "deploy/test_deploy.py",  # the nginx/replica deployment pieces together
    "rollout/test_adapter_mappings.py", "rollout/test_adapter_sampling_masks.py",  # every trainer adapter at once
    "session_server/engine/test_reply_shapes.py",  # SGLang's reply shapes through the engine client
    "session_server/frontend/test_api_mapping.py",  # each API's request -> the shared turn request
    "session_server/http/test_head_limit.py",  # the request head's size limit, as uvicorn and the server apply it
    "session_server/test_event_loop.py",  # what keeps the one event loop responsive
    "sglang_sim/test_engine_books.py", "sglang_sim/test_native_tags.py", "sglang_sim/test_prefix_limit.py",
    "test_architecture.py", "test_exported_members.py", "test_workshop.py",
    "trajectory/families/test_families.py", "trajectory/families/test_oracles.py",
    "trajectory/families/test_thinking_mode.py",  # every model family against the same rules and oracles
    "trajectory/test_control_tokens.py", "trajectory/test_tokenizers.py",
}


def test_unit_tests_are_named_after_the_module_they_test() -> None:
    unit = ROOT / "tests" / "unit"
    stray = []
    for path in sorted(unit.rglob("test_*.py")):
        rel = path.relative_to(unit)
        if not (ROOT / rel.parent / path.name[len("test_"):]).exists() and rel.as_posix() not in CONCERN_TESTS:
            stray.append(rel.as_posix())
    assert stray == [], "unit test modules named after no module (rename, or add to CONCERN_TESTS)"
    assert sorted(name for name in CONCERN_TESTS if not (unit / name).exists()) == []  # no stale entry
