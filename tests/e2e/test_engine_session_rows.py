"""An open engine session keeps one of the engine's request rows until it is closed (SGLang 0.5.23, which the sim
emulates with --max-running-requests): with more trajectories holding one than the engine has rows, every other
request waits forever (issue 43: 24 sessions on an engine with 8 rows left 16 /generate unanswered).

- Without a cap (--max-engine-sessions-per-engine 0), 24 second turns on an 8-row engine: at most 8 are answered,
  the others wait out the server's deadline (504). Never more than 8 can run, however fast the machine is.
- With the default cap (the engine's rows less a quarter: 6 of 8), the same burst answers every turn: 6 open an engine
  session, 18 go without (their records say so, the metrics count them); once DELETEs close the 6, a later turn of the
  others opens one again.
Each test deletes its sessions and leaves the engine's books at zero, so the order of the tests does not matter.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from support.server import assert_engine_baseline, chat_url, engine_info, metric
from support.sim import wait_for
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
ROWS, SESSIONS = 8, 24
CAP = 6  # the server's default: ROWS less a quarter of them
REPLY = "[[sim: tokens 5]]"
WAIT = 300.0  # a bound on waiting for an event, never a measure of speed
STALL_DEADLINE = "10"  # the uncapped server's --request-timeout: how long its starved turns wait before a 504


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--enable-streaming-session", "--max-running-requests", str(ROWS)],
                       servers={"capped": ["--engine-sessions", "--request-timeout", str(WAIT)],
                                "uncapped": ["--engine-sessions", "--max-engine-sessions-per-engine", "0",
                                             "--request-timeout", STALL_DEADLINE]}) as stack:
        yield stack


def _user(i: int, turn: int) -> dict[str, str]:
    return {"role": "user", "content": f"episode {i} turn {turn} {REPLY}"}


async def _turns(server: str, sids: list[str], histories: list[list[dict[str, str]]], turn: int) -> Counter[int]:
    """One more turn of every session at once; a 200's reply joins its history."""
    limits = httpx.Limits(max_connections=SESSIONS + 8, max_keepalive_connections=SESSIONS + 8)
    async with httpx.AsyncClient(timeout=WAIT, limits=limits) as http:
        for i, history in enumerate(histories):
            history.append(_user(i, turn))
        replies = await asyncio.gather(*(http.post(chat_url(server, sid), json={"messages": history})
                                         for sid, history in zip(sids, histories, strict=True)))
    for history, reply in zip(histories, replies, strict=True):
        if reply.status_code == 200:
            history.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    return Counter(r.status_code for r in replies)


def _first_turns(server: str) -> tuple[list[str], list[list[dict[str, str]]]]:
    sids = [httpx.post(f"{server}/sessions", timeout=WAIT).json()["session_id"] for _ in range(SESSIONS)]
    histories: list[list[dict[str, str]]] = [[] for _ in sids]
    assert asyncio.run(_turns(server, sids, histories, 1)) == Counter({200: SESSIONS})
    assert _open_by_server(server) == 0  # first turns have nothing to reuse: none opened
    return sids, histories


def _open_by_server(server: str) -> int:
    """The engine sessions the server counts open on its (only) engine."""
    return int(httpx.get(f"{server}/ready", timeout=WAIT).json()["engines"][0]["engine_sessions"])


def _latest_modes(server: str, sids: list[str]) -> dict[str, str]:
    return {sid: httpx.get(f"{server}/sessions/{sid}", timeout=WAIT).json()["records"][-1]["engine_session"]
            for sid in sids}


def _delete(server: str, sids: list[str]) -> None:
    for sid in sids:
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=WAIT).status_code == 204


def test_without_a_cap_sessions_past_the_rows_starve_the_other_turns(stack: Stack) -> None:
    server = stack["uncapped"]
    sids, histories = _first_turns(server)
    statuses = asyncio.run(_turns(server, sids, histories, 2))
    # The rows went to the first engine sessions to run a turn, which keep them: the rest never ran.
    assert statuses.keys() <= {200, 504} and statuses[200] <= ROWS and statuses[504] >= SESSIONS - ROWS, statuses
    _delete(server, sids)  # their closes free the rows
    assert_engine_baseline(stack.engine)


def test_with_the_cap_every_turn_is_answered_and_a_freed_slot_is_taken_again(stack: Stack) -> None:
    server = stack["capped"]
    at_cap_before = metric(server, "session_server_engine_sessions_at_cap_total")
    sids, histories = _first_turns(server)
    assert asyncio.run(_turns(server, sids, histories, 2)) == Counter({200: SESSIONS})
    modes = _latest_modes(server, sids)
    assert Counter(modes.values()) == Counter({"opened": CAP, "without": SESSIONS - CAP})
    assert metric(server, "session_server_engine_sessions_at_cap_total") - at_cap_before == SESSIONS - CAP
    assert engine_info(stack.engine)["open_sessions"] == CAP and _open_by_server(server) == CAP

    holders = [sid for sid in sids if modes[sid] == "opened"]
    _delete(server, holders)  # their closes free the slots (in the background: waited for)
    wait_for(lambda: _open_by_server(server) == 0, WAIT, 0.05)
    rest = [sid for sid in sids if sid not in holders]
    rest_histories = [histories[sids.index(sid)] for sid in rest]
    assert asyncio.run(_turns(server, rest, rest_histories, 3)) == Counter({200: len(rest)})
    assert Counter(_latest_modes(server, rest).values()) == Counter({"opened": CAP, "without": len(rest) - CAP})

    _delete(server, rest)
    wait_for(lambda: _open_by_server(server) == 0, WAIT, 0.05)
    assert_engine_baseline(stack.engine)
