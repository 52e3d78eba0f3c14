"""POST /sessions/{id}/fork against real processes (the sim behind a recording proxy): a child's next turn sends the
engine exactly the ids the parent's next turn would have sent from the fork point, through any of the three APIs;
children are independent; refusals create nothing; the journal brings children back after a restart; samples carry
the lineage (trajectory/forks.py, issue 39)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from harness.launchers import start_session_server
from rollout.client import SessionClient
from sglang_sim.directives import reply, tool_call
from support.examples import examples
from support.server import RecordingProxy, chat_url, engine_info, new_session, wait_engine_sessions
from support.stack import Stack, StackFactory
from trajectory.sample_metadata import sample_metadata

FAMILY = "qwen3"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}]
APIS = ("chat", "responses", "messages")


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    servers = {"forks": ["--max-rollback", "8", "--max-fork", "4", "--max-sessions", "400"]}
    with stack_factory(family=FAMILY, sim_args=["--enable-streaming-session", "--token-latency-ms", "1"],
                       proxied={"forks"}, servers=servers) as stack:
        yield stack


def chat(server: str, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    resp = httpx.post(chat_url(server, sid), json={"model": "m", "messages": messages, "tools": TOOLS}, timeout=60)
    assert resp.status_code == 200, resp.text
    message: dict[str, Any] = resp.json()["choices"][0]["message"]
    return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls") and v is not None}


def fork(server: str, sid: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server}/sessions/{sid}/fork", json=body, timeout=30)


def info(server: str, sid: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{server}/sessions/{sid}", timeout=30).json()
    return body


def as_responses(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for m in history:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
            continue
        if m.get("content") or m["role"] != "assistant":
            items.append({"role": m["role"], "content": m.get("content") or ""})
        for call in m.get("tool_calls") or ():
            items.append({"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})
    return items


def as_messages(history: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    system = history[0]["content"] if history[0]["role"] == "system" else None
    out: list[dict[str, Any]] = []
    for m in history[1 if system is not None else 0:]:
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif m["role"] == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls") or ()]
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return system, out


def next_turn(server: str, sid: str, api: str, history: list[dict[str, Any]]) -> httpx.Response:
    base = f"{server}/sessions/{sid}/v1"
    if api == "chat":
        return httpx.post(f"{base}/chat/completions", json={"model": "m", "messages": history, "tools": TOOLS},
                          timeout=60)
    if api == "responses":
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        return httpx.post(f"{base}/responses", json={"model": "m", "input": as_responses(history), "tools": tools},
                          timeout=60)
    system, messages = as_messages(history)
    tools = [{"name": "add", "description": "Add.", "input_schema": {"type": "object"}}]
    body = {"model": "m", "max_tokens": 64, "messages": messages, "tools": tools, **({"system": system} if system
                                                                                  else {})}
    return httpx.post(f"{base}/messages", json=body, timeout=60)


def engine_ids(proxy: RecordingProxy, server: str, sid: str, api: str, history: list[dict[str, Any]]) -> list[int]:
    proxy.clear()
    resp = next_turn(server, sid, api, history)
    assert resp.status_code == 200, resp.text
    (call,) = proxy.generates()
    ids: list[int] = call["request"]["input_ids"]
    return ids


def play(server: str, sid: str, turns: list[str], system: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Chat turns (each a user message or, after a tool call, the tool's answer); returns the history and the
    message count after each turn."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    ends = []
    for i, kind in enumerate(turns):
        last = history[-1]
        if last.get("tool_calls"):
            history.append({"role": "tool", "tool_call_id": last["tool_calls"][0]["id"], "content": f"{i}"})
        directive = tool_call("add", a=i, b=1) if kind == "tool" else reply(f"answer {i}")
        history.append({"role": "user", "content": f"step {i} {directive}"})
        history.append(chat(server, sid, history))
        ends.append(len(history))
    return history, ends


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_childs_next_turn_sends_the_engine_the_parents_ids(stack: Stack, proxy: RecordingProxy,
                                                             data: st.DataObject) -> None:
    """Random histories (tool calls; a second segment where drawn) and fork points; the child's next turn through
    a random API against the parent's same turn (a rollback to the fork point when it is earlier than the end)."""
    server = stack["forks"]
    parent = new_session(server)
    made = [parent]
    try:
        check_fork(server, proxy, data, parent, made)
    finally:  # hypothesis may stop an example at any draw: its sessions go all the same
        for sid in made:
            httpx.delete(f"{server}/sessions/{sid}", timeout=30)


def check_fork(server: str, proxy: RecordingProxy, data: st.DataObject, parent: str, made: list[str]) -> None:
    kinds = st.lists(st.sampled_from(["tool", "text"]), min_size=1, max_size=3)
    history, ends = play(server, parent, data.draw(kinds, label="turns"), "main agent")
    if data.draw(st.booleans(), label="second segment"):  # a sub-agent: the session's current segment is its own
        history, ends = play(server, parent, data.draw(kinds, label="sub-agent turns"), "sub-agent")
        assert len(info(server, parent)["segments"]) == 2
    at = data.draw(st.integers(1, len(ends)), label="at")
    api = data.draw(st.sampled_from(APIS), label="api")
    resp = fork(server, parent, n=2, at=at, metadata={"branch": "x"})
    assert resp.status_code == 200, resp.text
    child, sibling = resp.json()["session_ids"]
    made += [child, sibling]
    before = info(server, sibling)
    request = [*history[:ends[at - 1]], {"role": "user", "content": f"and now? {reply('fine')}"}]
    if request[-2].get("tool_calls"):
        request.insert(-1, {"role": "tool", "tool_call_id": request[-2]["tool_calls"][0]["id"], "content": "2"})
    ids = engine_ids(proxy, server, child, api, request)
    grown = info(server, child)
    assert len(grown["segments"]) == 1 and len(grown["records"]) == at + 1  # it continued the forked history
    assert grown["lineage"]["fork_turns"] == at and grown["lineage"]["depth"] == 1
    assert grown["metadata"] == {"branch": "x"}
    sibling_after = info(server, sibling)
    for volatile in ("busy", "nbytes"):
        before.pop(volatile), sibling_after.pop(volatile)
    assert sibling_after == before  # nothing the child did reached its sibling
    assert engine_ids(proxy, server, parent, api, request) == ids


def test_refusals_create_nothing(stack: Stack) -> None:
    server = stack["forks"]
    sid = new_session(server)
    fresh = fork(server, sid, n=2)  # no turn yet: nothing to fork
    assert fresh.status_code == 400 and fresh.json()["error"]["type"] == "invalid_fork_point"
    play(server, sid, ["text"], "s")

    def live() -> list[str]:
        return sorted(s["id"] for s in httpx.get(f"{server}/admin/sessions", timeout=30).json()["sessions"])

    before = live()
    assert fork(server, sid, n=5).status_code == 400  # --max-fork 4
    assert fork(server, sid, n=0).status_code == 400
    assert fork(server, sid, n=2, at=2).status_code == 400  # one turn: at 2 is no turn boundary
    assert fork(server, "nope", n=2).status_code == 404
    assert live() == before and sid in before
    ok = fork(server, sid, n=4)
    assert ok.status_code == 200 and len(set(ok.json()["session_ids"])) == 4
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204
    assert fork(server, sid, n=1).status_code == 404  # deleted
    for child in ok.json()["session_ids"]:  # the children outlive their parent
        assert info(server, child)["lineage"]["parent_session"] == sid
        assert httpx.delete(f"{server}/sessions/{child}", timeout=30).status_code == 204


def test_past_max_sessions_nothing_is_created_and_samples_carry_the_lineage(stack: Stack, tmp_path: Path) -> None:
    proc = start_session_server(stack.engine, stack.tok, FAMILY, "--max-sessions", "3", name="small",
                                log_dir=stack.logs)
    try:
        server = proc.url
        sid = new_session(server)
        play(server, sid, ["tool", "text"], "s")
        refused = fork(server, sid, n=3)  # 1 + 3 > 3: all or none; 429 (the server is up), not 503
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "too_many_sessions"
        assert int(refused.headers["retry-after"]) >= 1
        never = httpx.post(f"{server}/sessions/{sid}/fork", json={"n": 4}, timeout=30)  # more than it ever holds
        assert never.status_code == 400
        assert len(httpx.get(f"{server}/admin/sessions", timeout=30).json()["sessions"]) == 1
        (child, _sibling) = fork(server, sid, n=2).json()["session_ids"]
        samples = httpx.post(f"{server}/sessions/{child}/samples", timeout=30).json()
        assert len(samples) == 1
        lineage = samples[0]["metadata"]["lineage"]
        assert lineage["parent_session"] == sid and lineage["root_session"] == sid and lineage["depth"] == 1
        assert lineage["fork_position"] == len(samples[0]["tokens"]) and lineage["fork_turns"] == 2
        parent_samples = httpx.post(f"{server}/sessions/{sid}/samples", timeout=30).json()
        assert "lineage" not in parent_samples[0]["metadata"]
        assert parent_samples[0]["tokens"] == samples[0]["tokens"]
    finally:
        proc.stop()


def test_children_survive_a_restart_on_the_journal(stack: Stack, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"

    def start() -> Any:
        return start_session_server(stack.engine, stack.tok, FAMILY, "--journal", str(journal), "--max-rollback",
                                    "4", name="journaled", log_dir=stack.logs)

    proc = start()
    server = proc.url
    parent = new_session(server, {"task": 1})
    history, ends = play(server, parent, ["tool", "text", "text"], "s")
    (child,) = fork(server, parent, n=1, at=2).json()["session_ids"]
    request = [*history[:ends[1]], {"role": "user", "content": f"more {reply('ok')}"}]
    assert next_turn(server, child, "chat", request).status_code == 200
    (grandchild,) = fork(server, child, n=1, at=2).json()["session_ids"]  # a fork of a fork: its cuts chain
    assert httpx.delete(f"{server}/sessions/{parent}", timeout=30).status_code == 204
    states = {sid: (info(server, sid), httpx.post(f"{server}/sessions/{sid}/samples", timeout=30).json())
              for sid in (child, grandchild)}
    assert proc.stop() == 0
    proc = start()
    try:
        for sid, (was, samples) in states.items():
            now = info(proc.url, sid)
            for volatile in ("busy", "nbytes"):
                now.pop(volatile), was.pop(volatile)
            assert now == was
            assert httpx.post(f"{proc.url}/sessions/{sid}/samples", timeout=30).json() == samples
        assert states[grandchild][0]["lineage"]["depth"] == 2
        assert states[grandchild][0]["lineage"]["root_session"] == parent
        assert next_turn(proc.url, grandchild, "chat", request).status_code == 200
        assert len(info(proc.url, grandchild)["records"]) == 3
    finally:
        proc.stop()


def test_session_client_forks_and_samples_read_the_lineage(stack: Stack) -> None:
    server = stack["forks"]

    async def main() -> None:
        async with SessionClient([server]) as client:
            sid = await client.create({"task": "group"})
            play(server, sid, ["tool"], "s")
            children = await client.fork(sid, 3, metadata={"member": 1})
            assert len(children) == 3 and client.open_sessions() == {server: 4}
            assert all(client.server_of(c) == server for c in children)
            for child in children:
                for sample in await client.collect(child):  # safetensors: the metadata as the trainer reads it
                    lineage = sample_metadata(sample).lineage
                    assert lineage is not None and lineage.parent == sid and lineage.depth == 1
                    assert lineage.position == len(sample.tokens) and lineage.turns == 1
            assert len({sample_metadata(s).lineage.group for c in children  # type: ignore[union-attr]
                        for s in await client.collect(c)}) == 1  # one fork call, one group
            for session in (sid, *children):
                assert await client.delete(session)
            assert client.open_sessions() == {server: 0}

    asyncio.run(main())


def test_children_open_their_own_engine_sessions(stack: Stack) -> None:
    """With --engine-sessions a child has no engine session of its parent's: its first turn opens one and sends the
    whole prompt; the parent's engine session holds its history outside the radix cache (SGLang's streaming sessions
    publish only their first prompt), so the fork has the engine prefill the forked prefix once and each child's turn
    finds it cached; every engine session is closed with its session."""
    proc = start_session_server(stack.engine, stack.tok, FAMILY, "--engine-sessions", name="engine-sessions",
                                log_dir=stack.logs)
    try:
        server = proc.url
        parent = new_session(server)
        history, _ = play(server, parent, ["tool", "text"], "s")
        made = fork(server, parent, n=2).json()
        children, position = made["session_ids"], made["fork_position"]
        assert made["prefill"]["prompt_tokens"] == position
        for i, sid in enumerate([*children, parent]):
            request = [*history, {"role": "user", "content": f"branch {i} {reply('done')}"}]
            assert next_turn(server, sid, "chat", request).status_code == 200
            records = info(server, sid)["records"]
            assert len(records) == 3
            # the parent's second turn opened its engine session; a child's first turn opens its own
            assert records[-1]["engine_session"] == ("reused" if sid == parent else "opened")
            assert records[-1]["cached_tokens"] >= position - 2
        assert engine_info(stack.engine)["open_sessions"] == 3  # one each: a child's is its own
        for sid in (parent, *children):
            assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204
        assert wait_engine_sessions(stack.engine, 0)["open_sessions"] == 0  # closed after the DELETEs answered
    finally:
        proc.stop()


def first_turn_counts(server: str) -> tuple[float, float]:
    """The first-turn cache's (hits, misses) from /metrics: a render and a repeat each move one."""
    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{server}/metrics", timeout=10).text)
              for s in f.samples}
    return (values["session_server_first_turn_cache_hits_total"],
            values["session_server_first_turn_cache_misses_total"])


def test_a_group_forks_at_its_primed_prompt(stack: Stack, proxy: RecordingProxy) -> None:
    """A GRPO group as a fork: the prompt is primed once (one render), the children's first turns render nothing and
    send the engine exactly what a fresh session's first turn sends; a child that sends another first request renders
    it; the children's samples name the prompt's length as their fork position; a primed session with a turn is 400
    to prime again."""
    server = stack["forks"]
    prompt = [{"role": "system", "content": "You are a careful agent."},
              {"role": "user", "content": f"Solve task 39. {reply('solved')}"}]
    fresh = new_session(server)
    proxy.clear()
    assert next_turn(server, fresh, "chat", prompt).status_code == 200
    (call,) = proxy.generates()
    expected: list[int] = call["request"]["input_ids"]
    parent = new_session(server)
    primed = httpx.post(f"{server}/sessions/{parent}/prime", json={"messages": prompt, "tools": TOOLS}, timeout=30)
    assert primed.status_code == 200, primed.text
    assert primed.json()["prompt_tokens"] == len(expected)
    made = fork(server, parent, n=3).json()
    assert made["fork_turns"] == 0 and made["fork_position"] == len(expected)
    children = made["session_ids"]
    before = first_turn_counts(server)
    for child in children[:2]:
        assert engine_ids(proxy, server, child, "chat", prompt) == expected
    assert first_turn_counts(server) == before  # neither rendered nor looked up: the primed ids
    other = [*prompt[:1], {"role": "user", "content": f"Another task. {reply('ok')}"}]
    rendered = engine_ids(proxy, server, children[2], "chat", other)
    assert rendered[:5] == expected[:5] and rendered != expected
    assert sum(first_turn_counts(server)) == sum(before) + 1
    samples = httpx.post(f"{server}/sessions/{children[0]}/samples", timeout=30).json()
    lineage = samples[0]["metadata"]["lineage"]
    assert lineage["fork_position"] == len(expected) and lineage["parent_session"] == parent
    assert samples[0]["tokens"][:len(expected)] == expected
    again = httpx.post(f"{server}/sessions/{children[0]}/prime", json={"messages": prompt}, timeout=30)
    assert again.status_code == 400
    for sid in (fresh, parent, *children):
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


def test_a_primed_group_prefills_its_prompt_once(stack: Stack, proxy: RecordingProxy) -> None:
    """The prime has the engine prefill the prompt (max_new_tokens 0) before it answers, so the group's first turns,
    sent all at once, each find it in the radix cache and prefill only the prompt's last token (the one SGLang always
    computes): on the engine's books the group prefilled the prompt once, whatever order its turns came in."""
    server = stack["forks"]
    prompt = [{"role": "system", "content": "Rules: " + " ".join(f"rule {i}." for i in range(60))},
              {"role": "user", "content": f"Prefilled task. {reply('done')}"}]
    parent = new_session(server)
    proxy.clear()
    primed = httpx.post(f"{server}/sessions/{parent}/prime", json={"messages": prompt, "tools": TOOLS}, timeout=30)
    assert primed.status_code == 200, primed.text
    n = primed.json()["prompt_tokens"]
    done = primed.json()["prefill"]
    assert done["prompt_tokens"] == n and done["cached_tokens"] < 10  # another test's prompt may share its opening
    (prime_call,) = [c for c in proxy.settled() if c["path"] == "/generate"]
    assert prime_call["request"]["sampling_params"]["max_new_tokens"] == 0
    assert prime_call["response"]["meta_info"]["completion_tokens"] == 0
    children = fork(server, parent, n=4).json()["session_ids"]

    async def first_turns() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(client.post(chat_url(server, sid), json={
                "model": "m", "messages": prompt, "tools": TOOLS}) for sid in children)))

    assert all(r.status_code == 200 for r in asyncio.run(first_turns()))
    calls = [c for c in proxy.settled() if c["path"] == "/generate"]
    assert len(calls) == 5 and all(c["request"]["input_ids"] == prime_call["request"]["input_ids"] for c in calls)
    prefilled = [c["response"]["meta_info"]["prompt_tokens"] - c["response"]["meta_info"]["cached_tokens"]
                 for c in calls]
    assert prefilled == [n - done["cached_tokens"], 1, 1, 1, 1]  # the prompt once, then each child's last token
    assert all(info(server, sid)["records"][0]["cached_tokens"] == n - 1 for sid in children)
    assert httpx.get(f"{stack.engine}/sim/books", timeout=30).json()["ok"]
    for sid in (parent, *children):
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


def test_a_prefill_past_the_request_timeout_is_aborted_by_its_rid(stack: Stack, proxy: RecordingProxy) -> None:
    """The prime's prefill is an engine request like a turn's: held by the engine far past --request-timeout (a delay
    fault of 600 s against 1 s), the prime answers without it (`prefill: null`, still primed) and the request is
    aborted by its rid, so the engine ends it and frees what it held, rather than leaving it to run."""
    proc = start_session_server(proxy.url, stack.tok, FAMILY, "--request-timeout", "1", name="short-timeout",
                                log_dir=stack.logs)
    try:
        sid = new_session(proc.url)
        proxy.clear()
        assert httpx.post(f"{stack.engine}/sim/faults", json={"delay": 1.0, "delay_seconds": 600}).status_code == 200
        try:
            primed = httpx.post(f"{proc.url}/sessions/{sid}/prime", timeout=60, json={
                "messages": [{"role": "user", "content": "A prime the engine holds."}]})
        finally:
            httpx.post(f"{stack.engine}/sim/faults", json={})
        assert primed.status_code == 200, primed.text
        assert primed.json()["prefill"] is None and primed.json()["prompt_tokens"] > 0
        calls = proxy.settled()
        (prime_call,) = [c for c in calls if c["path"] == "/generate"]
        rid = prime_call["request"]["rid"]
        assert [c["request"].get("rid") for c in calls if c["path"] == "/abort_request"] == [rid]
        assert prime_call["status"] == 499  # the sim ended the held request (its answer to one aborted while held)
        assert httpx.delete(f"{proc.url}/sessions/{sid}", timeout=30).status_code == 204
    finally:
        proc.stop()


def test_a_group_in_one_request(stack: Stack, proxy: RecordingProxy) -> None:
    """POST /sessions with `prime` and `n`: the group's sessions at one primed prompt, in one request -- rendered once,
    prefilled once, no root session left to delete; `prime` alone is one primed session; `n` without `prime`, or
    above --max-fork, creates nothing."""
    server = stack["forks"]
    prompt = [{"role": "system", "content": "One request. " + " ".join(f"rule {i}." for i in range(30))},
              {"role": "user", "content": f"Group task. {reply('ok')}"}]
    fresh = new_session(server)
    expected = engine_ids(proxy, server, fresh, "chat", prompt)
    before = first_turn_counts(server)
    proxy.clear()
    made = httpx.post(f"{server}/sessions", json={"metadata": {"task": 7}, "n": 3,
                                                  "prime": {"messages": prompt, "tools": TOOLS}}, timeout=30)
    assert made.status_code == 200, made.text
    group = made.json()
    assert group["prompt_tokens"] == group["fork_position"] == len(expected) and group["fork_turns"] == 0
    assert group["prefill"]["prompt_tokens"] == len(expected)
    assert [c["request"]["sampling_params"]["max_new_tokens"] for c in proxy.generates()] == [0]
    assert httpx.get(f"{server}/sessions/{group['root_session']}", timeout=30).status_code == 404
    for sid in group["session_ids"]:
        assert engine_ids(proxy, server, sid, "chat", prompt) == expected
        child = info(server, sid)
        assert child["metadata"] == {"task": 7} and child["records"][0]["cached_tokens"] == len(expected) - 1
        assert child["lineage"]["parent_session"] == child["lineage"]["root_session"] == group["root_session"]
        assert child["lineage"]["group"] == group["group"]
    assert sum(first_turn_counts(server)) == sum(before) + 1  # the prime's render (a lookup); the turns, nothing
    single = httpx.post(f"{server}/sessions", json={"prime": {"messages": prompt, "tools": TOOLS}}, timeout=30)
    assert single.status_code == 200 and single.json()["prompt_tokens"] == len(expected)
    assert engine_ids(proxy, server, single.json()["session_id"], "chat", prompt) == expected
    def live() -> list[str]:
        return sorted(s["id"] for s in httpx.get(f"{server}/admin/sessions", timeout=30).json()["sessions"])

    was = live()
    for body in ({"n": 2}, {"n": 5, "prime": {"messages": prompt}}, {"n": 2, "prime": "text"}):
        assert httpx.post(f"{server}/sessions", json=body, timeout=30).status_code == 400, body
    assert live() == was
    for sid in (fresh, single.json()["session_id"], *group["session_ids"]):
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


def test_session_client_runs_a_group_as_forks(stack: Stack) -> None:
    server = stack["forks"]
    prompt = [{"role": "user", "content": f"group task {reply('x')}"}]

    async def main() -> None:
        async with SessionClient([server]) as client:
            children = await client.group(4, prompt, TOOLS, metadata={"task": 1})
            assert len(children) == 4 and client.open_sessions() == {server: 4}  # the parent is gone
            for child in children:
                assert next_turn(server, child, "chat", prompt).status_code == 200
                assert await client.delete(child)

    asyncio.run(main())


def test_a_group_forked_at_its_prompt_survives_a_restart(stack: Stack, proxy: RecordingProxy, tmp_path: Path) -> None:
    """The journal keeps the primed prompt (its request, rendered again at the restart) with the fork at it: after a
    restart the primed parent and a child that has not taken its turn are still primed -- the child's first turn
    renders nothing and sends the ids the primed prompt held -- and a child that took its turn is as it was, holding
    the prompt by reference again (its own bytes do not count the prompt)."""
    journal = tmp_path / "journal.sqlite"

    def start() -> Any:
        return start_session_server(proxy.url, stack.tok, FAMILY, "--journal", str(journal), name="journaled-group",
                                    log_dir=stack.logs)

    prompt = [{"role": "system", "content": "On disk. " + " ".join(f"rule {i}." for i in range(150))},
              {"role": "user", "content": f"a group on disk {reply('kept')}"}]
    proc = start()
    server = proc.url
    parent = new_session(server)
    assert httpx.post(f"{server}/sessions/{parent}/prime", json={"messages": prompt, "tools": TOOLS},
                      timeout=30).status_code == 200
    took, waited, deleted = fork(server, parent, n=3).json()["session_ids"]
    first = engine_ids(proxy, server, took, "chat", prompt)
    assert httpx.delete(f"{server}/sessions/{deleted}", timeout=30).status_code == 204
    grouped = httpx.post(f"{server}/sessions", json={"n": 2, "prime": {"messages": prompt, "tools": TOOLS}},
                         timeout=30).json()["session_ids"]  # a group in one request: its primed prompt on disk too
    single = httpx.post(f"{server}/sessions", json={"prime": {"messages": prompt, "tools": TOOLS}},
                        timeout=30).json()["session_id"]  # one session primed in the request that opens it
    was = info(server, took)
    assert proc.stop() == 0
    proc = start()
    try:
        now = info(proc.url, took)
        for volatile in ("busy", "nbytes"):
            now.pop(volatile), was.pop(volatile)
        assert now == was
        # 9 bytes a stored token (id, logprob, mask): the prompt's are the primed prompt's, held by reference
        assert info(proc.url, took)["nbytes"] < len(first) * 9 / 2
        assert info(proc.url, waited)["lineage"]["fork_position"] == len(first)
        before = first_turn_counts(proc.url)
        assert engine_ids(proxy, proc.url, waited, "chat", prompt) == first
        assert engine_ids(proxy, proc.url, parent, "chat", prompt) == first
        assert engine_ids(proxy, proc.url, grouped[0], "chat", prompt) == first
        assert engine_ids(proxy, proc.url, single, "chat", prompt) == first
        assert first_turn_counts(proc.url) == before  # all took the primed ids: no render, no lookup
        for sid in (parent, took, waited, *grouped, single):  # the last holder of a primed prompt takes its row
            assert httpx.delete(f"{proc.url}/sessions/{sid}", timeout=30).status_code == 204
    finally:
        proc.stop()
    with contextlib.closing(sqlite3.connect(journal)) as conn:
        assert conn.execute("SELECT count(*) FROM primes").fetchone()[0] == 0
