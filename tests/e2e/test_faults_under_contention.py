"""The adversarial cases on a slow, loaded machine: the engine and the session servers pinned to one core shared with
busy loops (tests/support/contention.py), so they get a fraction of it, whatever the machine.

Each case ends with the cleanup check -- the engine back to its baseline: nothing running, no engine session, no KV
after a flush, its books balanced -- and the session usable (or deleted). Nothing here waits for a time or bounds
one: every step waits for the event it needs (a request running at the engine, a status, the engine idle), with a
generous bound only so that a hang fails instead of blocking the suite.

- a burst of 300 new sessions with --engine-sessions: every first turn 200 (an open that does not answer in time
  degrades to a plain turn, never a 502), and after the DELETEs no engine session or KV is left;
- the engine SIGSTOPped mid-chat: the chat ends at its deadline (504), DELETE answers; once the engine runs again the
  retried abort and close land and it is back to baseline;
- a session server SIGSTOPped mid-chat while its client gives up: once it runs again it sees the disconnect, aborts
  the engine request, and the session's next turn is answered;
- a session server SIGKILLed mid-chat and restarted on its journal: every committed turn is back exactly, the killed
  server's engine request is gone, its engine session (--engine-sessions) is closed by the restarted server, and the
  session goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.launchers import start_session_server
from support.contention import busy_loops, contended_core
from support.server import assert_engine_baseline, chat_url, engine_info, new_session, wait_engine_idle, wait_running
from support.sim import wait_for
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
WAIT = 300.0  # a bound on waiting for an event under contention, never a measure of speed
SHORT = {"messages": [{"role": "user", "content": "hi [[sim: tokens 3]]"}]}
ENDLESS = {"messages": [{"role": "user", "content": "endless [[sim: tokens 20000]]"}], "max_tokens": 20000}
T = "3"  # --request-timeout of the servers whose engine is frozen: the chat's deadline must pass during the freeze


@pytest.fixture(scope="module")
def core() -> int:
    return contended_core()


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory, core: int) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--enable-streaming-session", "--token-latency-ms", "5"],
                       servers={"burst": ["--engine-sessions"],
                                "plain": ["--request-timeout", T],
                                "es": ["--engine-sessions", "--request-timeout", T]},
                       cpus=[core]) as stack:
        yield stack


@pytest.fixture
def contention(stack: Stack, core: int) -> Iterator[None]:
    with busy_loops(core):
        yield


def _engine_clean(stack: Stack) -> None:
    """Once everything that ended is ended on the engine (retried aborts and closes included): the baseline."""
    wait_engine_idle(stack.engine, WAIT)
    wait_for(lambda: engine_info(stack.engine)["open_sessions"] == 0, WAIT, 0.05)
    assert_engine_baseline(stack.engine)


def test_a_burst_of_new_sessions_gets_no_502_and_leaves_nothing(stack: Stack, contention: None) -> None:
    """300 first turns at once with --engine-sessions (the burst that once gave 228 x 502, the opens not answering
    within the control timeout): every chat is answered 200, and after the DELETEs the engine holds nothing."""
    server = stack["burst"]

    async def main() -> Counter[int]:
        async with httpx.AsyncClient(timeout=WAIT, limits=httpx.Limits(max_connections=300)) as http:
            sids = [(await http.post(f"{server}/sessions")).json()["session_id"] for _ in range(300)]
            replies = await asyncio.gather(*(http.post(chat_url(server, s), json=SHORT) for s in sids))
            for sid in sids:
                assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204
            return Counter(r.status_code for r in replies)

    assert asyncio.run(main()) == Counter({200: 300})
    _engine_clean(stack)


@pytest.mark.parametrize("name", ["plain", "es"])
def test_a_stopped_engine_costs_a_504_and_leaves_nothing_once_it_runs(stack: Stack, contention: None,
                                                                      name: str) -> None:
    server, engine_pid = stack[name], stack.procs[0].pid
    sid = new_session(server)

    async def main() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=WAIT) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json=ENDLESS))
            await wait_running(stack.engine)
            os.kill(engine_pid, signal.SIGSTOP)
            try:
                status = (await chat).status_code
                deleted = (await http.delete(f"{server}/sessions/{sid}")).status_code  # does not wait for it
            finally:
                os.kill(engine_pid, signal.SIGCONT)
            return status, deleted

    assert asyncio.run(main()) == (504, 204)
    _engine_clean(stack)


@pytest.mark.parametrize("name", ["plain", "es"])
def test_a_stopped_server_whose_client_gives_up_aborts_once_it_runs(stack: Stack, contention: None,
                                                                   name: str) -> None:
    server = stack[name]
    server_pid = next(p.pid for p in stack.procs if p.name == name)
    sid = new_session(server)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=WAIT) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json=ENDLESS))
            await wait_running(stack.engine)
            os.kill(server_pid, signal.SIGSTOP)
            try:
                chat.cancel()  # the client gives up while the server cannot run: its connection closes
                await asyncio.gather(chat, return_exceptions=True)
            finally:
                os.kill(server_pid, signal.SIGCONT)

    asyncio.run(main())
    wait_engine_idle(stack.engine, WAIT)  # the server saw the disconnect and aborted the engine request
    r = httpx.post(chat_url(server, sid), json=SHORT, timeout=WAIT)
    assert r.status_code == 200, r.text  # the slot is free: the next turn runs
    assert len(httpx.get(f"{server}/sessions/{sid}", timeout=WAIT).json()["records"]) == 1
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=WAIT).status_code == 204
    _engine_clean(stack)


def _state(server: str, sid: str) -> dict[str, Any]:
    info = httpx.get(f"{server}/sessions/{sid}", timeout=WAIT).json()
    info.pop("busy", None)
    info.pop("nbytes", None)
    return {"info": info, "samples": httpx.post(f"{server}/sessions/{sid}/samples", timeout=WAIT).json()}


@pytest.mark.parametrize("engine_sessions", [False, True], ids=["plain", "es"])
def test_a_killed_server_restarted_on_its_journal_goes_on_and_leaves_nothing(
    stack: Stack, core: int, tmp_path: Path, engine_sessions: bool
) -> None:
    """With --engine-sessions the killed server's engine session outlives it (the engine's idle timeout is the
    request timeout plus a minute): the restarted server closes it from the journal's book before anything else."""
    journal = tmp_path / "journal.sqlite"
    extra = ["--engine-sessions"] if engine_sessions else []

    def start() -> Any:
        return start_session_server(stack.engine, stack.tok, FAMILY, "--journal", str(journal), *extra,
                                    name="journaled", log_dir=stack.logs, cpus=[core], startup_timeout=WAIT)

    with busy_loops(core):
        proc = start()
        try:
            sid = new_session(proc.url)
            history = list(SHORT["messages"])
            for turn in range(2):
                r = httpx.post(chat_url(proc.url, sid), json={"messages": history}, timeout=WAIT)
                assert r.status_code == 200, r.text
                reply = r.json()["choices"][0]["message"]
                history += [reply, {"role": "user", "content": f"more {turn} [[sim: tokens 3]]"}]
            before = _state(proc.url, sid)

            async def killed_mid_chat() -> None:
                async with httpx.AsyncClient(timeout=WAIT) as http:
                    chat = asyncio.ensure_future(http.post(chat_url(proc.url, sid), json=ENDLESS))
                    await wait_running(stack.engine)
                    proc.proc.send_signal(signal.SIGKILL)
                    with pytest.raises(httpx.TransportError):
                        await chat

            asyncio.run(killed_mid_chat())
            proc.proc.wait(WAIT)
            wait_engine_idle(stack.engine, WAIT)  # the engine aborted the request whose connection died
            assert engine_info(stack.engine)["open_sessions"] == (1 if engine_sessions else 0)  # left by the killed
        finally:
            proc.stop()
        proc = start()
        try:
            wait_for(lambda: engine_info(stack.engine)["open_sessions"] == 0, WAIT, 0.05)  # closed by the restart
            assert _state(proc.url, sid) == before  # every committed turn, exactly
            r = httpx.post(chat_url(proc.url, sid), json={"messages": history}, timeout=WAIT)
            assert r.status_code == 200, r.text
            assert len(_state(proc.url, sid)["info"]["records"]) == 3
            assert httpx.delete(f"{proc.url}/sessions/{sid}", timeout=WAIT).status_code == 204
        finally:
            assert proc.stop() == 0, proc.tail()
    _engine_clean(stack)
