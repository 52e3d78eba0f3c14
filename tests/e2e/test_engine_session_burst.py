"""A GRPO step's burst under --engine-sessions (issue 43), sized for CI: 300 sessions open at once and chat a first
turn each, then a second turn each while 30 of their clients vanish mid-reply, then every session is deleted -- on a
quiet stack and on one pinned to a core shared with two busy loops (tests/support/contention.py).

What must hold, none of it measured by a clock (the deadlines are the server's own; every wait is for an event,
bounded only so that a hang fails):
- the first turns open no engine session (they have nothing to reuse: each record says "deferred", the engine
  holds none), so a single-turn GRPO step costs the engine no open and no close;
- every surviving chat is answered 200: no 504 from the server's own queueing of engine control calls (the
  /open_session in front of each second turn), no 502;
- every DELETE answers 204 without waiting for the engine: the engine holds every /close_session unanswered (the
  sim's /sim/hold_closes) while the DELETEs are sent, and a control call's deadline is longer than any wait here, so
  a DELETE that waited for its close would stay blocked; all 300 are answered while the engine has answered none of
  the closes, which are then under way in the background;
- once the closes are let through, the engine's books end at zero (no engine session, nothing running, no KV);
- a turn that went without its engine session is counted: the server's fallback counter covers the turns whose
  record says "without" (on a machine this slow or this quiet, the count is what it is; the test does not guess it).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from support.contention import busy_loops, contended_core
from support.server import assert_engine_baseline, chat_url, engine_info, metric
from support.sim import wait_for
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
SESSIONS, VANISHING = 300, 30
WAIT = 300.0  # a bound on waiting for an event, never a measure of speed
REPLY = "[[sim: tokens 150]]"
ENDLESS = "[[sim: tokens 2000]]"  # a vanishing client's reply, longer than the others: its client goes first
# The quiet stack has the deadline; the contended one (a third of a core) a deadline that only a queue in
# the server could reach, so no verdict depends on the machine's speed.
TIMEOUTS = {"quiet": "4", "contended": "60"}
# Longer than any wait here: a DELETE that waited for its held close would stay blocked past WAIT, not time out.
CONTROL_TIMEOUT = "3600"


@pytest.fixture(scope="module", params=sorted(TIMEOUTS))
def stack(request: pytest.FixtureRequest, stack_factory: StackFactory) -> Iterator[Stack]:
    contended = request.param == "contended"
    core = contended_core() if contended else None
    with stack_factory(family=FAMILY, sim_args=["--enable-streaming-session", "--token-latency-ms", "2",
                                                "--kv-capacity-tokens", "400000"],
                       servers={"es": ["--engine-sessions", "--request-timeout", TIMEOUTS[request.param],
                                       "--engine-control-timeout", CONTROL_TIMEOUT]},
                       cpus=None if core is None else [core]) as stack:
        if core is None:
            yield stack
        else:
            with busy_loops(core):
                yield stack


def _closes(stack: Stack) -> dict[str, int]:
    return httpx.get(f"{stack.engine}/sim/hold_closes", timeout=WAIT).json()


def _hold_closes(stack: Stack, hold: bool) -> None:
    assert httpx.post(f"{stack.engine}/sim/hold_closes", json={"hold": hold}, timeout=WAIT).status_code == 200


def test_a_grpo_burst_answers_every_chat_and_delete_and_leaves_nothing(stack: Stack) -> None:
    server = stack["es"]
    vanishing = set(range(0, SESSIONS, SESSIONS // VANISHING))
    fallbacks_before = metric(server, "session_server_engine_session_fallbacks_total")

    def first(i: int) -> dict[str, str]:
        return {"role": "user", "content": f"episode {i} {REPLY}"}

    async def first_turns(http: httpx.AsyncClient) -> tuple[list[str], list[str]]:
        sids = [(await http.post(f"{server}/sessions")).json()["session_id"] for _ in range(SESSIONS)]
        replies = await asyncio.gather(*(http.post(chat_url(server, sid), json={"messages": [first(i)]})
                                         for i, sid in enumerate(sids)))
        assert Counter(r.status_code for r in replies) == Counter({200: SESSIONS})
        return sids, [r.json()["choices"][0]["message"]["content"] for r in replies]

    async def burst() -> tuple[list[str], Counter[int]]:
        limits = httpx.Limits(max_connections=SESSIONS + 8, max_keepalive_connections=SESSIONS + 8)
        async with httpx.AsyncClient(timeout=WAIT, limits=limits) as http:
            sids, answers = await first_turns(http)
            assert engine_info(stack.engine)["open_sessions"] == 0  # the first turns opened none

            def chat(i: int, sid: str) -> asyncio.Future[httpx.Response]:
                content = f"episode {i} {ENDLESS if i in vanishing else REPLY}"
                return asyncio.ensure_future(http.post(chat_url(server, sid), json={"messages": [
                    first(i), {"role": "assistant", "content": answers[i]}, {"role": "user", "content": content}]}))

            chats = {i: chat(i, sid) for i, sid in enumerate(sids)}
            surviving = await asyncio.gather(*(c for i, c in chats.items() if i not in vanishing))
            for i in vanishing:  # their replies run on at the engine (or their deadline passed): they go away now
                chats[i].cancel()
            await asyncio.gather(*(chats[i] for i in vanishing), return_exceptions=True)
            return sids, Counter(r.status_code for r in surviving)

    sids, statuses = asyncio.run(burst())
    assert statuses == Counter({200: SESSIONS - VANISHING})

    # Every turn says how it used its engine session, and the ones that went without are the ones counted.
    modes: Counter[str] = Counter()
    for sid in sids:
        first_record, *later = httpx.get(f"{server}/sessions/{sid}", timeout=WAIT).json()["records"]
        assert first_record["engine_session"] == "deferred"
        for record in later:
            modes[record["engine_session"]] += 1
    committed = sum(modes.values())  # a vanishing client's reply may have ended before its client went
    assert SESSIONS - VANISHING <= committed <= SESSIONS and modes.keys() <= {"opened", "without"}, modes
    fallbacks = metric(server, "session_server_engine_session_fallbacks_total") - fallbacks_before
    # Each committed turn that went without was counted; beyond those, only the vanished clients' turns that
    # committed nothing (so no record names them) may have been.
    assert modes["without"] <= fallbacks <= modes["without"] + SESSIONS - committed, (fallbacks, modes)

    _hold_closes(stack, True)
    try:
        closes_before = _closes(stack)

        async def delete_all() -> Counter[int]:
            async with httpx.AsyncClient(timeout=WAIT) as http:
                return Counter([(await http.delete(f"{server}/sessions/{sid}")).status_code for sid in sids])

        assert asyncio.run(delete_all()) == Counter({204: SESSIONS})
        # Every DELETE was answered while the engine answered none of their closes: none of them waited for one.
        assert _closes(stack)["answered"] == closes_before["answered"]
        under_way = httpx.get(f"{server}/admin/sessions", timeout=WAIT).json()["engine_sessions"]
        assert under_way["closes_under_way"] > 0, under_way
    finally:
        _hold_closes(stack, False)
    wait_for(lambda: httpx.get(f"{server}/admin/sessions", timeout=WAIT).json()["engine_sessions"][
        "closes_under_way"] == 0, WAIT, 0.05)
    assert_engine_baseline(stack.engine)
    assert httpx.get(f"{server}/admin/sessions", timeout=WAIT).json()["engine_sessions"]["unclosed"] == []

