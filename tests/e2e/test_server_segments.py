"""Histories that are not one line, against real processes with the official openai SDK as the agent: a compacting
agent, a sub-agent during an in-flight turn, DELETE with several segments running, the reject policy and a journal
restart with segments (trajectory/session_segments.py, docs/design.md 4)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sglang_sim.directives import reply, tokens, tool_call
from support.server import (
    as_history,
    assert_engine_baseline,
    chat_url,
    metric,
    new_session,
    session_client,
    wait_engine_idle,
    wait_running,
)
from support.stack import Stack, StackFactory, start_session_server

FAMILY = "qwen3"
TOKEN_MS = 10
TOOLS: list[Any] = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
SYSTEM = {"role": "system", "content": "You are a coding agent."}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--token-latency-ms", str(TOKEN_MS)],
                       servers={"server": [], "reject": ["--on-divergence", "reject"]}) as stack:
        yield stack


def samples(server: str, sid: str) -> list[dict[str, Any]]:
    resp = httpx.post(f"{server}/sessions/{sid}/samples", timeout=30)
    assert resp.status_code == 200, resp.text
    body: list[dict[str, Any]] = resp.json()
    return body


async def turn(client: openai.AsyncOpenAI, messages: list[Any]) -> tuple[Any, httpx.Headers]:
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=messages, tools=TOOLS)
    assert raw.status_code == 200
    return raw.parse(), raw.headers


def test_compacting_agent_keeps_all_five_turns_in_two_segments(stack: Stack) -> None:
    server = stack["server"]
    sid = new_session(server)
    completion_tokens: list[int] = []

    async def agent() -> list[httpx.Headers]:
        headers = []
        async with session_client(server, sid) as client:
            messages: list[Any] = [SYSTEM, {"role": "user", "content": f"fix it {tool_call('run', cmd='ls')}"}]
            for k in range(5):
                if k == 3:  # the harness compacts: its history becomes the system prompt and a summary
                    messages = [SYSTEM, {"role": "user", "content": "Summary: listed, built and tested. Continue. "
                                                                    f"{tool_call('run', cmd='ship')}"}]
                completion, seen = await turn(client, messages)
                headers.append(seen)
                completion_tokens.append(completion.usage.completion_tokens)
                message = completion.choices[0].message
                messages.append(as_history(message))
                if message.tool_calls:
                    nxt = tool_call("run", cmd=f"step {k}") if k < 2 else reply("All done.")
                    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                     "content": f"output {k} {nxt}"})
                else:
                    messages.append({"role": "user", "content": f"go on {tokens(4)}"})
        return headers

    started_before = metric(server, 'session_server_segments_started_total{reason="divergence"}', 0)
    headers = asyncio.run(agent())
    assert [h.get("x-session-segment") for h in headers] == [
        None, None, None, "1; started; reason=divergence; parent=0; branch_turn=3", "1"]
    assert not any(h.get("x-session-rollback") for h in headers)
    got = samples(server, sid)
    assert [(s["metadata"]["segment"], s["metadata"]["num_turns"], s["metadata"]["reason"]) for s in got] == [
        (0, 3, "first"), (1, 2, "divergence")]
    assert got[1]["metadata"]["parent"] == 0 and got[1]["metadata"]["branch_turn"] == 3
    assert sum(sum(s["loss_mask"]) for s in got) == sum(completion_tokens)  # every sampled token of all 5 turns
    for s in got:
        assert all(lp == 0.0 for lp, m in zip(s["rollout_log_probs"], s["loss_mask"], strict=True) if not m)
    info = httpx.get(f"{server}/sessions/{sid}").json()
    assert [(s["segment"], s["num_turns"]) for s in info["segments"]] == [(0, 3), (1, 2)]
    assert len(info["records"]) == 3 and len(info["segment_trajectories"]["1"]["records"]) == 2
    assert metric(server, 'session_server_segments_started_total{reason="divergence"}') == started_before + 1
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_sub_agent_during_an_in_flight_turn_gets_200(stack: Stack) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)

    async def main() -> None:
        async with session_client(server, sid) as client, httpx.AsyncClient(timeout=60) as http:
            # 6 s at the engine: the sub-agent's short turn and the contender come long before its end
            big_job = [SYSTEM, {"role": "user", "content": f"big job {tokens(600)}"}]
            main_turn = asyncio.ensure_future(turn(client, big_job))
            await wait_running(engine, 1)
            sub, sub_headers = await turn(client, [{"role": "system", "content": "You are a sub-agent."},
                                                   {"role": "user", "content": f"look it up {tokens(3)}"}])
            assert not main_turn.done()  # ran concurrently with the main turn
            assert sub_headers["x-session-segment"].startswith("1; started; reason=new_conversation; parent=0")
            # A second request for the busy main segment is still 409.
            contender = await http.post(chat_url(server, sid), json={"messages": big_job})
            assert contender.status_code == 409
            _, headers = await main_turn
            assert "x-session-segment" not in headers
            assert sub.usage.completion_tokens == 3 + 1  # + the stop token

    asyncio.run(main())
    got = samples(server, sid)
    assert [(s["metadata"].get("segment"), s["metadata"].get("reason")) for s in got] == [
        (0, "first"), (1, "new_conversation")]
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    wait_engine_idle(engine)


def test_delete_aborts_every_running_segment(stack: Stack) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            running = [asyncio.ensure_future(http.post(chat_url(server, sid), json={"messages": [
                {"role": "user", "content": f"agent {i} {tokens(3000)}"}]})) for i in range(3)]  # cut: 30 s
            await wait_running(engine, 3)
            deleted = await http.delete(f"{server}/sessions/{sid}")
            assert deleted.status_code == 204
            return [r.status_code for r in await asyncio.gather(*running)]

    assert sorted(asyncio.run(main())) == [404, 404, 404]  # each told its session was deleted during the chat
    assert httpx.get(f"{server}/sessions/{sid}").status_code == 404
    wait_engine_idle(engine)
    assert_engine_baseline(engine)


def test_reject_policy_is_a_400_and_one_turn_at_a_time(stack: Stack) -> None:
    server = stack["reject"]
    sid = new_session(server)
    for k in range(2):
        history = httpx.get(f"{server}/sessions/{sid}").json()["messages"]
        resp = httpx.post(chat_url(server, sid), json={"messages": [*history, {"role": "user", "content": f"q{k}"}]})
        assert resp.status_code == 200, resp.text
    diverged = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "other"}]})
    assert diverged.status_code == 400 and diverged.json()["error"]["code"] == "rollback_limit_exceeded"
    assert len(samples(server, sid)) == 1 and "segment" not in samples(server, sid)[0]["metadata"]
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_journal_restores_segments(stack: Stack, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    proc = start_session_server(stack.engine, stack.tok, FAMILY, "--journal", str(journal), name="journaled",
                                log_dir=stack.logs)
    try:
        server = proc.url
        sid = new_session(server)
        for first in ("main task", "side request", "sub-agent task"):
            resp = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": first}]},
                              timeout=30)
            assert resp.status_code == 200, resp.text
        before = samples(server, sid), httpx.get(f"{server}/sessions/{sid}").json()["segments"]
        assert [s["metadata"]["segment"] for s in before[0]] == [0, 1, 2]
    finally:
        assert proc.stop() == 0
    proc = start_session_server(stack.engine, stack.tok, FAMILY, "--journal", str(journal), name="journaled",
                                log_dir=stack.logs)
    try:
        server = proc.url
        after = samples(server, sid), httpx.get(f"{server}/sessions/{sid}").json()["segments"]
        assert after == before
        # and a restored segment continues: its history extends segment 2
        history = httpx.get(f"{server}/sessions/{sid}").json()["segment_trajectories"]["2"]["messages"]
        resp = httpx.post(chat_url(server, sid), json={"messages": [*history, {"role": "user", "content": "more"}]},
                          timeout=30)
        assert resp.status_code == 200 and resp.headers["x-session-segment"] == "2"
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    finally:
        assert proc.stop() == 0


def test_a_sub_agent_that_disconnects_leaves_the_main_turn_running(stack: Stack) -> None:
    """Disconnect with several segments running: only the vanished client's engine request is aborted; the slot
    and the reserved segment id are freed, and the sub-agent's immediate retry is served."""
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    aborts = metric(server, "session_server_engine_aborts_total")
    # the sub-agent's first try is cut (its 30 s never run); the main turn's 6 s outlast the cut and the retry
    sub_agent = {"messages": [{"role": "system", "content": "sub-agent"}, {"role": "user", "content": tokens(3000)}]}

    async def main() -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            main_turn = asyncio.ensure_future(http.post(chat_url(server, sid), json={"messages": [
                {"role": "user", "content": f"main {tokens(600)}"}]}))
            await wait_running(engine, 1)
            sub = asyncio.ensure_future(http.post(chat_url(server, sid), json=sub_agent))
            await wait_running(engine, 2)
            sub.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await sub
            assert not main_turn.done()
            retry = await http.post(chat_url(server, sid), json={**sub_agent, "max_tokens": 3})
            assert retry.status_code == 200, retry.text
            assert retry.headers["x-session-segment"].startswith("2; started")  # ids are never reused
            return (await main_turn).status_code

    assert asyncio.run(main()) == 200
    assert metric(server, "session_server_engine_aborts_total") == aborts + 1
    got = samples(server, sid)
    assert [s["metadata"].get("segment") for s in got] == [0, 2]
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    wait_engine_idle(engine)
    assert_engine_baseline(engine)


def test_rollback_inside_a_later_segment(stack: Stack) -> None:
    server = stack["server"]
    sid = new_session(server)

    def chat(messages: list[Any]) -> httpx.Response:
        resp = httpx.post(chat_url(server, sid), json={"messages": messages}, timeout=30)
        assert resp.status_code == 200, resp.text
        return resp

    chat([{"role": "user", "content": "main"}])
    sub = [{"role": "system", "content": "sub-agent"}, {"role": "user", "content": "first"}]
    sub.append(chat(sub).json()["choices"][0]["message"])
    sub.append({"role": "user", "content": "second"})
    second = chat(sub)
    assert second.headers["x-session-segment"] == "1" and "x-session-rollback" not in second.headers
    retry = chat([*sub[:-1], {"role": "user", "content": "second, again"}])  # the last turn asked again
    assert retry.headers["x-session-segment"] == "1" and retry.headers["x-session-rollback"] == "1; reason=content"
    info = httpx.get(f"{server}/sessions/{sid}").json()
    assert [(s["segment"], s["num_turns"], s["rollbacks_by_reason"]) for s in info["segments"]] == [
        (0, 1, {}), (1, 2, {"content": 1})]
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
