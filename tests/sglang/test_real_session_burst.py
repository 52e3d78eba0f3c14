"""A GRPO-shaped burst of engine sessions against released SGLang 0.5.23 (issue 43), sized above the CPU engine's
request rows: 24 sessions open at once and chat a first turn each (which opens no engine session: nothing to reuse),
then a second turn each (which opens one, up to the server's cap per engine: the others go without), then are all
deleted at once.

What it shows of SGLang itself (through the recording proxy): the first turns send no `/open_session`; it answers
every `/open_session` of the second turns' burst (each waits for the scheduler's next iteration,
tokenizer_manager.py `open_session` and its future) and every
`/close_session` (answered once dispatched to the scheduler, `close_session`: it never waits for the close itself);
the server keeps up: every chat 200, every turn records how it used its engine session, every DELETE 204 with its
close landing in the background, one close per open, and the engine's KV back to zero.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from support.server import chat_url, metric
from support.sglang_engine import Served, ServeFactory, assert_engine_clean
from support.sim import wait_for

# Three times the engine's --max-running-requests (8, harness.launchers.SGLANG_CPU_FLAGS): an open engine session
# keeps one of those request rows until it is closed, so without the server's cap 16 of these turns waited out the
# proxy's read timeout (docs/engines.md); with it at most CAP hold one and the others go without.
ROWS = 8
SESSIONS = 3 * ROWS
CAP = ROWS - ROWS // 4  # the server's default --max-engine-sessions-per-engine
WAIT = 300.0  # a bound on waiting for an event, never a measure of speed


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense", "--engine-sessions") as s:
        yield s


def test_a_burst_of_engine_sessions_opens_and_closes_every_one(served: Served) -> None:
    server, proxy = served.server, served.proxy
    proxy.clear()

    async def burst() -> tuple[Counter[int], Counter[int]]:
        async with httpx.AsyncClient(timeout=WAIT) as http:
            sids = [(await http.post(f"{server}/sessions")).json()["session_id"] for _ in range(SESSIONS)]
            firsts = [[{"role": "user", "content": f"Episode {i}: say something."}] for i in range(SESSIONS)]
            replies = await asyncio.gather(*(http.post(chat_url(server, sid), json={
                "messages": firsts[i], "temperature": 0, "max_tokens": 6}) for i, sid in enumerate(sids)))
            assert Counter(r.status_code for r in replies) == Counter({200: SESSIONS}), [r.text[:200] for r in replies]
            assert not [c for c in proxy.calls if c["path"] == "/open_session"]  # the first turns opened none
            chats = await asyncio.gather(*(http.post(chat_url(server, sid), json={
                "messages": [*firsts[i], replies[i].json()["choices"][0]["message"],
                             {"role": "user", "content": "And then?"}], "temperature": 0,
                "max_tokens": 6}) for i, sid in enumerate(sids)))
            slowest = {path: max((c.get("finished", time.monotonic()) - c["started"] for c in proxy.calls
                                  if c["path"] == path), default=None) for path in ("/open_session", "/generate")}
            assert Counter(r.status_code for r in chats) == Counter({200: SESSIONS}), (
                [r.text[:200] for r in chats if r.status_code != 200], slowest)
            modes = Counter()
            for sid in sids:
                first, *later = (await http.get(f"{server}/sessions/{sid}")).json()["records"]
                assert first["engine_session"] == "deferred"
                for record in later:
                    modes[record["engine_session"]] += 1
            deletes = await asyncio.gather(*(http.delete(f"{server}/sessions/{sid}") for sid in sids))
            assert modes.keys() <= {"opened", "without"} and sum(modes.values()) == SESSIONS, modes
            assert 0 < modes["opened"] <= CAP, modes  # (an open that timed out under load also goes without)
            assert modes["without"] == metric(server, "session_server_engine_session_fallbacks_total", 0.0)
            return Counter(r.status_code for r in chats), Counter(r.status_code for r in deletes)

    chats, deletes = asyncio.run(burst())
    assert chats == Counter({200: SESSIONS}) and deletes == Counter({204: SESSIONS})

    def calls(path: str) -> list[dict[str, object]]:
        return [c for c in proxy.calls if c["path"] == path]

    # The closes land in the background after the DELETEs: one per engine session opened, each answered 200.
    wait_for(lambda: len(calls("/close_session")) >= len([c for c in calls("/open_session") if c.get("status") == 200]),
             WAIT, 0.05)
    settled = proxy.settled(WAIT)
    opened = [c for c in settled if c["path"] == "/open_session"]
    closed = [c for c in settled if c["path"] == "/close_session"]
    assert [c["status"] for c in opened] == [200] * len(opened) and [c["status"] for c in closed] == [200] * len(closed)
    assert sorted(c["request"]["session_id"] for c in closed) == sorted(c["response"] for c in opened)
    assert_engine_clean(served.engine, WAIT)
