"""The engine's KV books survive any interleaving of submits, aborts, pauses and session operations.

In-process (no HTTP) so hypothesis can explore many schedules quickly; the HTTP tests cover the same paths end to
end. After every step `check_books()` recounts the pool, the radix tree, request and session slots from scratch.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sglang_sim.engine import Engine, EngineConfig
from sglang_sim.family import EngineFamily
from sglang_sim.generation import SamplingParams
from sglang_sim.requests import BadRequest, GenerateInput, SimRequest
from sglang_sim.sessions import SessionParams
from support import virtual_time
from support.examples import examples


@pytest.fixture(scope="module")
def family(hf_tokenizers, families):
    return EngineFamily.create("qwen3", hf_tokenizers["qwen3"], family=families["qwen3"])


steps = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 40), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("abort_all")),
    st.tuples(st.just("pause"), st.sampled_from(["abort", "retract", "in_place"])),
    st.tuples(st.just("resume")),
    st.tuples(st.just("close"), st.integers(0, 2)),
    st.tuples(st.just("sleep"), st.integers(0, 20)),
    st.tuples(st.just("flush")),
), min_size=1, max_size=40)


async def _scenario(family: EngineFamily, ops: list[tuple]) -> None:
    engine = Engine(EngineConfig(kv_capacity_tokens=400, context_length=4096, token_latency_ms=0.5,
                                 enable_streaming_session=True, max_running_requests=3), family)
    sessions = [engine.open_session(None, 0, streaming=i < 2, timeout=None) for i in range(3)]
    prefixes = [np.arange(10 + 7 * k, 30 + 7 * k, dtype=np.int32) for k in range(4)]
    requests = []
    for n, op in enumerate(ops):
        kind = op[0]
        if kind == "submit":
            _, prefix, n_new, sess = op
            ids = np.concatenate([prefixes[prefix], np.full(n_new % 7 + 1, 100 + n, dtype=np.int32)])
            sp = None
            if sess < len(sessions) and sessions[sess] in engine.sessions:
                sp = SessionParams(id=sessions[sess])
            inp = GenerateInput(rid=f"r{n}", input_ids=ids, text=None, session_params=sp,
                                sampling=SamplingParams(max_new_tokens=n_new))
            try:
                requests.append(engine.submit(inp))
            except BadRequest:
                pass
        elif kind == "abort":
            engine.abort(f"r{op[1]}")
        elif kind == "abort_all":
            engine.abort(None, abort_all=True)
        elif kind == "pause":
            await engine.pause(op[1])
        elif kind == "resume":
            engine.resume()
        elif kind == "close":
            engine.close_session(sessions[op[1]])
        elif kind == "sleep":
            await asyncio.sleep(op[1] / 1000)
        elif kind == "flush":
            engine.flush_cache()
        books = engine.check_books()
        assert books["ok"], (op, books["errors"])
        if books["waiting_requests"]:
            event("a request waited")
        if books["kv_session_tokens"]:
            event("a session held KV")
    engine.resume()
    await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in requests)), timeout=60)  # only a hang fails
    if engine.check_books()["kv_session_tokens"]:
        event("a session held KV")
    for sid in sessions:
        engine.close_session(sid)
    books = engine.check_books()
    assert books["ok"], books["errors"]
    assert not engine.requests and not engine.sessions
    assert books["private"] == 0 and books["kv_locked_tokens"] == 0
    assert engine.flush_cache() and engine.pool.used == 0
    for req in requests:
        event(f"finish {req.finish_reason['type']}" + (" after retraction" if req.retractions else ""))
        assert req.finish_reason is not None
        assert len(req.output_ids) <= len(req.plan.output_ids)


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps)
def test_random_schedules_keep_the_books(family, ops):
    asyncio.run(_scenario(family, ops))


def test_prefill_latency_is_paid_only_for_uncached_tokens(family):
    """A second apart: the cold prefill of 1000 tokens takes 1 s, the warm one, 2 uncached tokens, 2 ms of it (on the
    loop's virtual clock: the time the engine waits, not the machine's own)."""
    async def scenario() -> tuple[float, float, int]:
        engine = Engine(EngineConfig(kv_capacity_tokens=10000, prefill_latency_ms=1000.0), family)
        prompt = np.arange(1000, 2000, dtype=np.int32)

        async def timed(ids: np.ndarray, rid: str) -> tuple[float, int]:
            started = asyncio.get_running_loop().time()
            req = engine.submit(GenerateInput(rid=rid, input_ids=ids, text=None,
                                              sampling=SamplingParams(max_new_tokens=4)))
            await req.done.wait()
            return asyncio.get_running_loop().time() - started, req.cached_tokens

        cold, _ = await timed(prompt, "cold")
        warm, cached = await timed(np.concatenate([prompt, [7, 8]]).astype(np.int32), "warm")
        return cold, warm, cached

    cold, warm, cached = virtual_time.run(scenario())
    assert cached == 1000 and cold == pytest.approx(1.0, abs=1e-3) and warm == pytest.approx(0.002, abs=1e-3)


def test_an_open_streaming_session_keeps_its_row_until_closed(family):
    """As SGLang 0.5.23 (session/streaming_session.py): with as many streaming sessions open, each past its first
    turn, as the engine has rows, any request needing a row of its own waits; closing one lets it in."""
    async def scenario() -> None:
        engine = Engine(EngineConfig(kv_capacity_tokens=4000, enable_streaming_session=True, max_running_requests=2),
                        family)

        def submit(rid: str, session: str | None = None) -> SimRequest:
            return engine.submit(GenerateInput(rid=rid, input_ids=np.arange(10, 30, dtype=np.int32), text=None,
                                               session_params=SessionParams(id=session) if session else None,
                                               sampling=SamplingParams(max_new_tokens=3)))

        sessions = [engine.open_session(None, 0, streaming=True, timeout=None) for _ in range(2)]
        for n, sid in enumerate(sessions):
            await asyncio.wait_for(submit(f"turn{n}", sid).done.wait(), 60)
        assert engine.rows_used() == 2
        waiting = submit("plain")  # admitted first, were a row free: its task runs before the next one's
        second = submit("turn-again", sessions[0])  # a session's next turn runs in the row it keeps
        await asyncio.wait_for(second.done.wait(), 60)
        assert waiting.state == "waiting" and not waiting.done.is_set()
        engine.close_session(sessions[1])
        await asyncio.wait_for(waiting.done.wait(), 60)
        assert waiting.finish_reason is not None and waiting.finish_reason["type"] != "abort"
        assert engine.check_books()["ok"] and engine.rows_used() == 1

    asyncio.run(scenario())


def test_appended_turn_drops_a_leading_bos(hf_tokenizers):
    from sglang_sim.sessions import EngineSession

    bos = hf_tokenizers["deepseek"].bos_token_id
    session = EngineSession.open(None, 0, streaming=True, timeout=None)
    session.history = np.array([bos, 5, 6], dtype=np.int32)
    prompt = session.build_prompt(SessionParams(id=session.session_id), np.array([bos, 9], dtype=np.int32), bos)
    assert prompt.tolist() == [bos, 5, 6, 9]
