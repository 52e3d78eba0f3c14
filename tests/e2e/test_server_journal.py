"""--journal against real processes: a restarted (or SIGKILLed) server comes back with every session it replied for.

One sim for the module; each test starts its own session servers on a journal file in a temp dir, stops or kills
them, and starts new ones on the same file. What a client received with 200 must be in the restored trajectory
exactly: the engine's tokens and logprobs (seen by a recording proxy between server and engine), the loss mask, the
messages. Deleted ids still answer "was deleted", the next turn works (and re-prefills), and the engine's books
return to baseline.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.launchers import ProcessCrashed, RunningProcess, start_session_server
from sglang_sim.directives import tool_call
from support.server import assert_engine_baseline, chat_url, new_session
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
TOKEN_MS = 2


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--token-latency-ms", str(TOKEN_MS)], servers={},
                       proxied={"journaled"}) as stack:
        yield stack


def start(stack: Stack, journal: Path, *args: str) -> RunningProcess:
    engine = stack.proxy.url if stack.proxy is not None else stack.engine
    return start_session_server(engine, stack.tok, FAMILY, "--journal", str(journal), *args, name="journaled",
                                log_dir=stack.logs)


def session_state(server: str, sid: str) -> dict[str, Any]:
    info = httpx.get(f"{server}/sessions/{sid}", timeout=30).json()
    for volatile in ("nbytes", "busy"):
        info.pop(volatile, None)
    samples = httpx.post(f"{server}/sessions/{sid}/samples", timeout=30).json()
    return {"info": info, "samples": samples}


def chat(server: str, sid: str, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    return httpx.post(chat_url(server, sid), json={"messages": messages, **extra}, timeout=60)


def test_restart_restores_sessions_deletions_and_continues(stack: Stack, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    proc = start(stack, journal)
    server = proc.url
    sids = [new_session(server, {"episode": i, "tags": ["a", "ü"]}) for i in range(3)]
    histories: dict[str, list[dict[str, Any]]] = {}
    for i, sid in enumerate(sids):
        history = [{"role": "user", "content": f"call a tool {i} [[sim: think]] {tool_call('add', a=i, b=2)}"}]
        first = chat(server, sid, history, tools=[{"type": "function", "function": {"name": "add"}}])
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        history += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                              "content": "3 [[sim: reply It is 3.]]"}]
        second = chat(server, sid, history, tools=[{"type": "function", "function": {"name": "add"}}])
        assert second.status_code == 200, second.text
        history.append(second.json()["choices"][0]["message"])
        histories[sid] = history
    # A retry of the last turn on session 1 rolls it back (journaled like any commit).
    retry = chat(server, sids[1], histories[sids[1]][:-1], tools=[{"type": "function", "function": {"name": "add"}}])
    assert retry.status_code == 200 and retry.headers.get("x-session-rollback")
    histories[sids[1]][-1] = retry.json()["choices"][0]["message"]
    assert httpx.delete(f"{server}/sessions/{sids[2]}").status_code == 204
    empty = new_session(server)  # a session without turns is restored too
    before = {sid: session_state(server, sid) for sid in (*sids[:2], empty)}
    assert proc.stop() == 0

    proc = start(stack, journal)
    try:
        server = proc.url
        for sid, state in before.items():
            assert session_state(server, sid) == state
        gone = httpx.get(f"{server}/sessions/{sids[2]}")
        assert gone.status_code == 404 and "was deleted" in gone.json()["error"]["message"]
        assert httpx.get(f"{server}/metrics").text.count("session_server_sessions 3.0") == 1
        # The next turn continues the restored trajectory (re-prefilled: the stored ids are the prompt's head).
        sid = sids[0]
        nxt = chat(server, sid, [*histories[sid], {"role": "user", "content": "and now? [[sim: tokens 3]]"}])
        assert nxt.status_code == 200, nxt.text
        after = httpx.get(f"{server}/sessions/{sid}").json()
        assert after["token_ids"][: len(before[sid]["info"]["token_ids"])] == before[sid]["info"]["token_ids"]
        assert len(after["records"]) == 3 and not nxt.headers.get("x-session-rollback")
        for sid in (*sids[:2], empty):
            assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    finally:
        assert proc.stop() == 0
    # The deleted sessions' rows are gone from the file; only tombstones remain.
    with sqlite3.connect(journal) as db:
        assert db.execute("SELECT count(*) FROM sessions").fetchone()[0] == 0
        assert db.execute("SELECT count(*) FROM turns").fetchone()[0] == 0
        assert db.execute("SELECT count(*) FROM tombstones").fetchone()[0] == 4
    assert_engine_baseline(stack.engine)


def test_streamed_turns_are_journaled(stack: Stack, tmp_path: Path) -> None:
    """`stream: true` commits through the same journaled path: restored exactly, and the session continues."""
    journal = tmp_path / "journal.sqlite"
    proc = start(stack, journal)
    sid = new_session(proc.url)
    history: list[dict[str, Any]] = []
    for i in range(3):
        history.append({"role": "user", "content": f"stream {i} [[sim: tokens {5 + i}]]"})
        resp = chat(proc.url, sid, history, stream=i != 1)
        assert resp.status_code == 200 and "error" not in resp.text, resp.text
        history = httpx.get(f"{proc.url}/sessions/{sid}").json()["messages"]
    before = session_state(proc.url, sid)
    assert len(before["info"]["records"]) == 3
    assert proc.stop() == 0
    proc = start(stack, journal)
    try:
        assert session_state(proc.url, sid) == before
        history.append({"role": "user", "content": "one more [[sim: tokens 2]]"})
        assert chat(proc.url, sid, history, stream=True).status_code == 200
        assert len(httpx.get(f"{proc.url}/sessions/{sid}").json()["records"]) == 4
        assert httpx.delete(f"{proc.url}/sessions/{sid}").status_code == 204
    finally:
        assert proc.stop() == 0


def test_journal_of_a_newer_schema_or_another_family_is_refused(stack: Stack, tmp_path: Path) -> None:
    newer = tmp_path / "newer.sqlite"
    proc = start(stack, newer)
    sid = new_session(proc.url)
    assert chat(proc.url, sid, [{"role": "user", "content": "hi [[sim: tokens 2]]"}]).status_code == 200
    assert proc.stop() == 0
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(ProcessCrashed, match="newer session-server"):
        start(stack, newer)
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(ProcessCrashed, match="not a session-server journal"):
        start(stack, foreign)
    other_family = tmp_path / "family.sqlite"
    proc = start(stack, other_family)
    new_session(proc.url)
    assert proc.stop() == 0
    with sqlite3.connect(other_family) as db:
        db.execute("UPDATE sessions SET family = 'deepseek'")
    with pytest.raises(ProcessCrashed, match="family"):
        start(stack, other_family)
    assert_engine_baseline(stack.engine)


def test_idle_clock_survives_a_restart(stack: Stack, tmp_path: Path) -> None:
    """The sweep continues from the journaled clocks: a session last used an hour before the restart (its clock
    moved back in the file, as after a long outage) expires at the first sweep; a fresh one stays."""
    journal = tmp_path / "journal.sqlite"
    proc = start(stack, journal, "--session-idle-timeout", "600")
    stale, fresh = new_session(proc.url), new_session(proc.url)
    assert proc.stop() == 0
    with sqlite3.connect(journal) as db:
        db.execute("UPDATE sessions SET last_active = last_active - 3600 WHERE id = ?", (stale,))
    proc = start(stack, journal, "--session-idle-timeout", "600")
    try:
        deadline = time.monotonic() + 30
        while "session_server_sessions_expired_total 1.0" not in httpx.get(f"{proc.url}/metrics").text:
            assert time.monotonic() < deadline, "the stale session was never swept"
            time.sleep(0.05)
        gone = httpx.get(f"{proc.url}/sessions/{stale}")
        assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
        assert httpx.get(f"{proc.url}/sessions/{fresh}").status_code == 200
    finally:
        assert proc.stop() == 0
    proc = start(stack, journal)  # the expiry was journaled like a DELETE
    try:
        gone = httpx.get(f"{proc.url}/sessions/{stale}")
        assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
        assert httpx.delete(f"{proc.url}/sessions/{fresh}").status_code == 204
    finally:
        assert proc.stop() == 0


# -- the crash test ------------------------------------------------------------------------------------------
def engine_generations(stack: Stack) -> dict[str, dict[str, Any]]:
    """rid -> what the engine generated for it (output ids and logprobs), from the recording proxy."""
    out = {}
    assert stack.proxy is not None
    for call in list(stack.proxy.calls):
        if call["path"] == "/generate" and call.get("status") == 200 and call.get("response"):
            meta = call["response"]["meta_info"]
            out[call["request"]["rid"]] = {
                "ids": call["response"]["output_ids"],
                "logprobs": [lp[0] for lp in meta["output_token_logprobs"]],
            }
    return out


def check_received_turns(server: str, stack: Stack, received: dict[str, list[dict[str, Any]]]) -> int:
    """Every reply a client got with 200 is a record of the restored trajectory with the engine's exact tokens,
    logprobs and loss mask; returns how many were checked."""
    generations = engine_generations(stack)
    checked = 0
    for sid, replies in received.items():
        resp = httpx.get(f"{server}/sessions/{sid}", timeout=30)
        assert resp.status_code == 200, resp.text
        info = resp.json()
        samples = httpx.post(f"{server}/sessions/{sid}/samples", timeout=30).json()
        by_rid = {r["rid"]: (i, r) for i, r in enumerate(info["records"])}
        # An agent only ever retries a turn it got no reply for, so no received turn is ever rolled back.
        lost = [r["rid"] for r in replies if r["rid"] not in by_rid]
        assert not lost, f"session {sid}: received replies missing after restart: {lost}"
        sample = samples[0]
        for reply in replies:
            i, record = by_rid[reply["rid"]]
            start, end = record["prompt_len"], record["prompt_len"] + record["completion_len"]
            gen = generations[reply["rid"]]
            assert record["completion_len"] == reply["completion_tokens"] == len(gen["ids"])
            trimmed = info["records"][i + 1]["trimmed"] if i + 1 < len(info["records"]) else 0
            assert sample["tokens"][start:end - trimmed] == gen["ids"][: len(gen["ids"]) - trimmed]
            assert sample["loss_mask"][start:end - trimmed] == [1] * (end - trimmed - start)
            got = sample["rollout_log_probs"][start:end - trimmed]
            assert got == pytest.approx(gen["logprobs"][: len(gen["ids"]) - trimmed], abs=1e-6)
            assert info["messages"][record_message_index(info, i)]["content"] == reply["content"]
            checked += 1
    return checked


def record_message_index(info: dict[str, Any], turn: int) -> int:
    return info["checkpoints"][turn]["num_messages"] - 1


async def agent(server: str, sid: str, received: list[dict[str, Any]], rng: random.Random, stop: asyncio.Event,
                history: list[dict[str, Any]]) -> None:
    """Chats until the server dies; keeps the history of replies it received (a retry re-sends an unanswered turn)."""
    async with httpx.AsyncClient(timeout=30) as http:
        while not stop.is_set():
            if not history or history[-1]["role"] == "assistant":
                text = f"go on {rng.random():.6f} [[sim: tokens {rng.randint(1, 40)}]]"
                history.append({"role": "user", "content": text})
            try:
                resp = await http.post(chat_url(server, sid), json={"messages": history})
            except httpx.TransportError:
                return
            if resp.status_code != 200:
                return
            body = resp.json()
            message = body["choices"][0]["message"]
            received.append({"rid": body["id"].removeprefix("chatcmpl-"), "content": message["content"],
                             "completion_tokens": body["usage"]["completion_tokens"]})
            history.append(message)


@pytest.mark.slow
def test_sigkill_at_random_points_loses_no_received_turn(stack: Stack, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    rng = random.Random(12)
    kills = 4
    received: dict[str, list[dict[str, Any]]] = {}
    histories: dict[str, list[dict[str, Any]]] = {}
    checked = 0
    proc = start(stack, journal)
    sids = [new_session(proc.url) for _ in range(8)]
    for sid in sids:
        received[sid], histories[sid] = [], []
    for _kill in range(kills):
        stop = asyncio.Event()

        async def run(victim: RunningProcess, stop: asyncio.Event = stop) -> None:
            tasks = [asyncio.create_task(agent(victim.url, sid, received[sid], rng, stop, histories[sid]))
                     for sid in sids]
            # Kill once the round has produced replies (a count, not a time: the machine may be slow), at a random
            # moment after that: mid-chat, mid-commit or mid-write, wherever the server is.
            target = sum(len(r) for r in received.values()) + rng.randint(len(sids), 3 * len(sids))
            deadline = time.monotonic() + 120
            while sum(len(r) for r in received.values()) < target and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            await asyncio.sleep(rng.uniform(0, 0.05))
            victim.proc.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks)

        asyncio.run(run(proc))
        proc.proc.wait(10)
        proc.stop()
        proc = start(stack, journal)
        checked += check_received_turns(proc.url, stack, {s: r for s, r in received.items() if r})
    try:
        # A final round on the restored server: every agent's retry repairs or extends its session normally.
        async def final(url: str) -> None:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(agent(url, sid, received[sid], rng, stop, histories[sid])) for sid in sids]
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)

        asyncio.run(final(proc.url))
        checked += check_received_turns(proc.url, stack, received)
        for sid in sids:
            assert httpx.delete(f"{proc.url}/sessions/{sid}").status_code == 204
    finally:
        assert proc.stop() == 0
    assert sum(len(r) for r in received.values()) >= len(sids) * kills, "too few turns between kills"
    assert checked >= sum(len(r) for r in received.values())
    assert_engine_baseline(stack.engine)
