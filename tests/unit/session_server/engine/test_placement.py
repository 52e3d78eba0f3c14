"""EnginePlacement's rules and routing, with in-process fake workers (no sockets): which worker a session gets, when
it moves (and its engine session with it), where its calls go, and how loads are read."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.engine.client import Answer, EngineReply
from session_server.engine.placement import EnginePlacement, _total_load
from session_server.engine.sessions import EngineSessions
from sglang_sim.wire import get_load, v1_loads


class FakeClient:
    def __init__(self, url: str, *, abort: Answer = Answer.DONE) -> None:
        self.base_url = url
        self.calls: list[tuple[str, Any]] = []
        self.abort_answer = abort
        self.info: dict[str, Any] | None = {"max_running_requests": 8}  # what its /server_info answers (None: no)

    async def server_info(self) -> dict[str, Any] | None:
        self.calls.append(("server_info", None))
        return self.info

    async def generate(self, payload: bytes, routing_key: str) -> EngineReply:
        self.calls.append(("generate", routing_key))
        return EngineReply(200, b"{}", "application/json")

    async def abort(self, rid: str) -> Answer:
        self.calls.append(("abort", rid))
        return self.abort_answer

    async def open_session(self, capacity: int, routing_key: str, idle_timeout: float | None = None,
                           session_id: str | None = None, deadline: float | None = None) -> str:
        self.calls.append(("open_session", routing_key))
        return f"sid-{self.base_url}"

    async def close_session(self, sid: str, routing_key: str) -> bool:
        self.calls.append(("close_session", sid))
        return True

    async def aclose(self) -> None:
        pass


def _pool(n: int, **kw: Any) -> tuple[EnginePlacement, list[FakeClient]]:
    clients = [FakeClient(f"http://w{i}", **kw) for i in range(n)]
    return EnginePlacement(clients, health_interval=0), clients  # type: ignore[arg-type]


def test_fewest_live_sessions_then_load() -> None:
    pool, _ = _pool(3)
    pool.workers[0].load, pool.workers[1].load, pool.workers[2].load = 5, 1, 3
    placed = [pool.place(f"s{i}").url for i in range(6)]
    assert placed == ["http://w1", "http://w2", "http://w0"] * 2
    pool.forget("s1")
    pool.forget("s1")  # idempotent
    assert [w.sessions for w in pool.workers] == [2, 2, 1]  # s1 was on w2
    assert pool.place("s6").url == "http://w2"


@settings(deadline=None)  # the shared 2-core machine, not the code, sets the pace
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9)), min_size=1, max_size=40), st.integers(1, 4))
def test_live_session_counts_stay_balanced(ops: list[tuple[bool, int]], n: int) -> None:
    """Whatever the sequence of new sessions and deletions, counts match the placement and differ by at most
    the deletions' imbalance: a new session always goes to a least-loaded healthy worker."""
    pool, _ = _pool(n)
    live: set[str] = set()
    for i, (create, k) in enumerate(ops):
        if create or not live:
            before = min(w.sessions for w in pool.workers)
            worker = pool.place(f"n{i}")
            assert worker.sessions == before + 1
            live.add(f"n{i}")
        else:
            victim = sorted(live)[k % len(live)]
            pool.forget(victim)
            live.discard(victim)
        assert sum(w.sessions for w in pool.workers) == len(live)


def test_a_forks_children_go_to_their_parents_worker_and_count_there() -> None:
    """The shared prefix (a primed prompt's prefill, the parent's turns) is in the parent's worker's radix cache."""
    pool, _ = _pool(3)
    pool.place("other")  # w0: the parent goes to the next least-loaded worker
    pool.place_beside(["c0", "c1", "c2"], "parent")
    assert {pool.place(s).url for s in ("parent", "c0", "c1", "c2")} == {"http://w1"}
    assert [w.sessions for w in pool.workers] == [1, 4, 0]
    pool.place_beside(["d0"], "unplaced")  # a parent with no worker yet is placed first, then its children beside it
    assert pool.place("d0") is pool.place("unplaced") is pool.workers[2]
    for sid in ("c0", "c1", "c2", "d0"):
        pool.forget(sid)
    assert [w.sessions for w in pool.workers] == [1, 1, 1]


def test_unhealthy_worker_takes_no_new_sessions_and_its_sessions_move() -> None:
    async def main() -> None:  # on a loop, as in the server: the move closes the old engine session in the background
        pool, clients = _pool(2)
        engine_sessions = EngineSessions(pool)
        moved: list[str] = []
        pool.on_move.append(lambda session_id, _worker: moved.append(session_id))
        assert pool.place("a").url == "http://w0"
        assert pool.place("b").url == "http://w1"
        await engine_sessions.begin_turn("b", 20)  # a turn with history to reuse opens one
        engine_sessions.committed("b", 42)
        pool.workers[1].healthy = False
        assert pool.place("c").url == "http://w0"
        assert pool.place("a").url == "http://w0"  # unaffected
        assert pool.place("b").url == "http://w0"  # moved on its next turn
        assert engine_sessions.state("b") is None  # reopened on the new worker by its next turn
        assert pool.moved == 1 and moved == ["b"]
        assert [w.sessions for w in pool.workers] == [3, 0]
        await asyncio.gather(*engine_sessions._orphans)
        assert ("close_session", "sid-http://w1") in clients[1].calls  # best effort on the old worker
        assert [w.engine_sessions for w in pool.workers] == [0, 0]  # its row on the old worker is counted free

    asyncio.run(main())


def test_a_workers_rows_are_asked_until_it_answers_and_then_never_again() -> None:
    async def main() -> None:
        pool, clients = _pool(1)
        worker = pool.worker_of("s")
        clients[0].info = None  # not answered (yet): no rows known, asked again next time
        assert await pool.rows_of(worker) is None
        clients[0].info = {"max_running_requests": None,
                           "internal_states": [{"effective_max_running_requests_per_dp": 6}]}
        assert await asyncio.gather(*(pool.rows_of(worker) for _ in range(5))) == [6] * 5
        assert await pool.rows_of(worker) == 6
        assert clients[0].calls.count(("server_info", None)) == 2  # concurrent asks share one call; then learned
        assert worker.describe()["max_running_requests"] == 6
        silent, (client,) = _pool(1)
        client.info = {"model_path": "m"}  # answered, without rows (e.g. a router): no cap, and not asked again
        assert [await silent.rows_of(silent.worker_of("s")) for _ in range(3)] == [None] * 3
        assert client.calls.count(("server_info", None)) == 1

    asyncio.run(main())


def test_no_healthy_worker_keeps_sessions_where_they_are() -> None:
    pool, _ = _pool(2)
    first = pool.place("s")
    for w in pool.workers:
        w.healthy = False
    assert pool.place("s") is first
    assert pool.moved == 0


def test_every_call_of_a_session_goes_to_its_worker() -> None:
    pool, clients = _pool(2)
    pool.place("x")
    pool.place("y")

    async def calls() -> Answer:
        await pool.generate(b"{}", "y")
        await pool.open_session(10, "y")
        await pool.close_session("sid", "y")
        return await pool.abort("rid-y", "y")

    assert asyncio.run(calls()) is Answer.DONE
    assert clients[0].calls == []
    assert [c[0] for c in clients[1].calls] == ["generate", "open_session", "close_session", "abort"]


def test_abort_of_an_unknown_session_reaches_every_worker_and_reports_refusal() -> None:
    pool, clients = _pool(2, abort=Answer.REFUSED)
    assert asyncio.run(pool.abort("rid")) is Answer.REFUSED
    assert [c.calls for c in clients] == [[("abort", "rid")], [("abort", "rid")]]


def test_an_abort_is_retried_when_any_worker_may_take_it_later() -> None:
    pool, clients = _pool(2, abort=Answer.REFUSED)
    clients[1].abort_answer = Answer.RETRY
    assert asyncio.run(pool.abort("rid")) is Answer.RETRY
    clients[0].abort_answer = Answer.DONE
    assert asyncio.run(pool.abort("rid")) is Answer.DONE


@pytest.mark.parametrize(("status", "answer"), [
    (200, Answer.DONE), (204, Answer.DONE), (503, Answer.RETRY), (500, Answer.RETRY), (429, Answer.RETRY),
    (408, Answer.RETRY), (404, Answer.REFUSED), (400, Answer.REFUSED), (401, Answer.REFUSED),
])
def test_an_engine_status_says_whether_a_control_call_is_worth_retrying(status: int, answer: Answer) -> None:
    assert Answer.of(status) is answer


class _Counts:
    """Just enough of the sim's Engine for wire.v1_loads / wire.get_load."""

    class pool:
        capacity = 100

    class config:
        max_running_requests = 8

    def counts(self) -> dict[str, int]:
        return {"running_requests": 3, "waiting_requests": 2, "kv_used_tokens": 40}

    def decode_moments(self) -> list[float] | None:
        return None  # no decode step timed yet


def test_loads_from_both_shapes() -> None:
    engine: Any = _Counts()
    assert _total_load(v1_loads(engine)) == 5  # SGLang 0.5.23 /v1/loads
    assert _total_load(get_load(engine)) == 5  # legacy /get_load: num_reqs counts running and waiting
    assert _total_load({"loads": "nope"}) is None
    assert _total_load([1]) is None


def _sglang_struct_fields(relpath: str, cls: str) -> list[str]:
    """Field names of a class in the installed SGLang 0.5.23 source, read with ast (importing sglang needs GPU deps)."""
    import ast
    from importlib.metadata import distribution
    from pathlib import Path

    # The installed files, not the module: the oracle tests put a stub `sglang` in sys.modules.
    root = Path(str(distribution("sglang").locate_file("sglang")))
    tree = ast.parse((root / relpath).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


def test_sim_load_snapshot_has_sglangs_core_fields() -> None:
    """The sim's /v1/loads rank is SGLang's LoadSnapshot "core" (srt/managers/load_snapshot.py `_CORE_KEYS`: every
    field but the sections), in its order."""
    sections = {"memory", "speculative", "lora", "disaggregation", "queues"}
    core = [f for f in _sglang_struct_fields("srt/managers/load_snapshot.py", "LoadSnapshot") if f not in sections]
    engine: Any = _Counts()
    assert list(v1_loads(engine)["loads"][0]) == core
    assert set(v1_loads(engine)) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
