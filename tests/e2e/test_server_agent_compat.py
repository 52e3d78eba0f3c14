"""What agents really send, against real processes: tool schemas in another key order, re-serialised tool-call
arguments, turns that omit or change `tools`, and one base URL for many episodes (X-Session-ID at the root).

Servers: "server" (defaults + --create-sessions-on-demand), "strict" (--message-matcher strict) and "plain"
(defaults: no on-demand creation), all in front of one sglang-sim (qwen3).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import assert_engine_baseline, chat_url, metric, new_session, sse_events, wait_running
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
TOKEN_MS = 5  # per generated token: long replies stay at the engine long enough to race against
PARAMS = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
# The same tool as two clients send it: equal as Python values, different as rendered text (tojson keeps order).
LOOKUP_A = {"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": PARAMS}}
LOOKUP_B = {"function": {"parameters": dict(reversed(PARAMS.items())), "description": "Look a key up.",
                         "name": "lookup"}, "type": "function"}
CALL = '[[sim: tool_call name=lookup args={"key": "x"}]]'


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--token-latency-ms", str(TOKEN_MS)],
        servers={"server": ["--create-sessions-on-demand"], "strict": ["--message-matcher", "strict"], "plain": []},
    ) as stack:
        yield stack


def _chat(server: str, sid: str, messages: list[dict[str, Any]], tools: Any = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return httpx.post(chat_url(server, sid), json=body, timeout=30)


def _ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    assert "x-session-rollback" not in resp.headers
    return resp.json()["choices"][0]["message"]


def _tool_turns(server: str, sid: str, tools: list[dict[str, Any]], compact: bool = False) -> list[dict[str, Any]]:
    """Turn 1 calls lookup; turn 2 answers. `compact` echoes the arguments as pydantic-ai does ({"key":"x"})."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"find x {CALL}"}]
    reply = _ok(_chat(server, sid, messages, tools))
    call = reply["tool_calls"][0]
    assert call["function"]["arguments"] == '{"key": "x"}'
    if compact:
        call = {**call, "function": {**call["function"], "arguments": '{"key":"x"}'}}
        reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": "42 [[sim: reply It is 42.]]"}]
    return messages


def _session(server: str, sid: str) -> dict[str, Any]:
    return httpx.get(f"{server}/sessions/{sid}", timeout=30).json()


def _rollbacks(server: str) -> dict[str, int]:
    prefix = 'session_server_rollbacks_total{reason="'
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return {line[len(prefix):].split('"', 1)[0]: int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines() if line.startswith(prefix)}


def test_tool_schemas_in_another_key_order_do_not_collide(stack: Stack, hf_tokenizers: dict[str, Any]) -> None:
    """Two clients, one server, the same tool in two key orders: each session renders its own text, no 400."""
    server = stack.server
    a, b = new_session(server), new_session(server)
    history_a = _tool_turns(server, a, [LOOKUP_A])
    history_b = _tool_turns(server, b, [LOOKUP_B])  # the first turn of B renders the tools in B's order
    assert _ok(_chat(server, a, history_a, [LOOKUP_A]))["content"] == "It is 42."
    assert _ok(_chat(server, b, history_b, [LOOKUP_B]))["content"] == "It is 42."
    tokenizer = hf_tokenizers[FAMILY]
    for sid, tool in ((a, LOOKUP_A), (b, LOOKUP_B)):
        info = _session(server, sid)
        assert len(info["records"]) == 2 and info["rollbacks"] == 0
        assert json.dumps(tool, ensure_ascii=False) in tokenizer.decode(info["token_ids"])
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack.engine)


def test_reserialised_arguments_match_by_default_and_roll_back_visibly_under_strict(stack: Stack) -> None:
    server = stack.server
    sid = new_session(server)
    assert _ok(_chat(server, sid, _tool_turns(server, sid, [LOOKUP_A], compact=True), [LOOKUP_A]))
    info = _session(server, sid)
    assert info["matcher"] == "loose_tool_call" and len(info["records"]) == 2 and info["rollbacks"] == 0
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204

    strict = stack["strict"]
    sid = new_session(strict)
    before = _rollbacks(strict)
    history = _tool_turns(strict, sid, [LOOKUP_A], compact=True)
    resp = _chat(strict, sid, history, [LOOKUP_A])
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-session-rollback"] == "1; reason=tool_call_arguments"
    assert _rollbacks(strict) == {**before, "tool_call_arguments": before["tool_call_arguments"] + 1}
    info = _session(strict, sid)
    assert info["rollbacks"] == 1 and info["rollbacks_by_reason"] == {"tool_call_arguments": 1}
    assert [r["rollback_reason"] for r in info["records"]] == ["tool_call_arguments"]  # turn 1 was replaced
    sample = httpx.post(f"{strict}/sessions/{sid}/samples", json={}).json()
    assert sample[0]["metadata"]["rollbacks"] == 1
    assert httpx.delete(f"{strict}/sessions/{sid}").status_code == 204


@pytest.mark.parametrize("later_tools", [None, [], [LOOKUP_B], [{"type": "function", "function": {"name": "other"}}]])
def test_a_later_turn_may_omit_or_change_tools(stack: Stack, later_tools: Any) -> None:
    server = stack["plain"]
    sid = new_session(server)
    history = _tool_turns(server, sid, [LOOKUP_A])
    first = _session(server, sid)["token_ids"]
    assert _ok(_chat(server, sid, history, later_tools))["content"] == "It is 42."
    info = _session(server, sid)
    assert len(info["records"]) == 2 and info["rollbacks"] == 0
    assert info["token_ids"][:len(first)] == first  # appended after the stored turn, nothing re-rendered
    assert info["tools"] == (later_tools or None) and info["prompt_tools"] == [LOOKUP_A]
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


# -- one base URL, X-Session-ID ----------------------------------------------------------------------------------

def _root_chat(server: str, headers: dict[str, Any], content: str = "hi [[sim: tokens 3]]") -> httpx.Response:
    return httpx.post(f"{server}/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": "m", "messages": [{"role": "user", "content": content}]})


def test_root_chat_addressed_by_header(stack: Stack) -> None:
    plain = stack["plain"]
    sid = new_session(plain)
    resp = _root_chat(plain, {"X-Session-ID": sid})
    assert resp.status_code == 200, resp.text
    assert len(_session(plain, sid)["records"]) == 1
    # The same session through its own URL continues the same trajectory.
    history = [{"role": "user", "content": "hi [[sim: tokens 3]]"}, resp.json()["choices"][0]["message"],
               {"role": "user", "content": "more [[sim: tokens 2]]"}]
    assert httpx.post(f"{plain}/v1/chat/completions", headers={"X-Session-ID": sid}, timeout=30,
                      json={"messages": history}).status_code == 200
    assert len(_session(plain, sid)["records"]) == 2

    missing = _root_chat(plain, {})
    assert missing.status_code == 400 and "X-Session-ID" in missing.json()["error"]["message"]
    unknown = _root_chat(plain, {"X-Session-ID": "episode-1"})
    assert unknown.status_code == 404
    message = unknown.json()["error"]["message"]
    assert "POST /sessions" in message and "--create-sessions-on-demand" in message
    assert httpx.get(f"{plain}/sessions/episode-1").status_code == 404  # nothing was created
    models = httpx.get(f"{plain}/v1/models")
    assert models.status_code == 200 and models.json()["object"] == "list"
    assert httpx.get(f"{plain}/v1/models", headers={"X-Session-ID": "episode-1"}).status_code == 404
    assert httpx.get(f"{plain}/v1/models", headers={"X-Session-ID": sid}).status_code == 200
    assert httpx.delete(f"{plain}/sessions/{sid}").status_code == 204
    assert _root_chat(plain, {"X-Session-ID": sid}).status_code == 404


@pytest.mark.parametrize("bad", ["", "a" * 129, "has space", "slash/id", "ünï", "semi;colon", "..%2f"])
def test_on_demand_ids_are_validated(stack: Stack, bad: str) -> None:
    server = stack.server
    resp = _root_chat(server, {"X-Session-ID": bad.encode()})  # raw UTF-8 bytes
    assert resp.status_code == 400, resp.text
    assert "X-Session-ID" in resp.json()["error"]["message"]
    assert _live_sessions(server) == 0  # nothing was created under the bad id


def _live_sessions(server: str) -> int:
    return int(metric(server, "session_server_sessions"))


def test_sessions_are_created_on_demand_and_never_revived(stack: Stack) -> None:
    server = stack.server
    sid = "rollout-7:example_3.a-b_c"
    resp = _root_chat(server, {"X-Session-ID": sid})
    assert resp.status_code == 200, resp.text
    info = _session(server, sid)
    assert info["session_id"] == sid and len(info["records"]) == 1
    samples = httpx.post(f"{server}/sessions/{sid}/samples", json={})
    assert samples.status_code == 200 and len(samples.json()) == 1
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    gone = _root_chat(server, {"X-Session-ID": sid})
    assert gone.status_code == 404 and "deleted" in gone.json()["error"]["message"]
    assert httpx.get(f"{server}/sessions/{sid}").status_code == 404
    assert_engine_baseline(stack.engine)


def test_paused_server_creates_nothing(stack: Stack) -> None:
    server = stack.server
    assert httpx.post(f"{server}/admin/pause").status_code == 200
    try:
        resp = _root_chat(server, {"X-Session-ID": "while-paused"})
        assert resp.status_code == 503 and resp.headers["retry-after"]
    finally:
        assert httpx.post(f"{server}/admin/continue").status_code == 200
    assert httpx.get(f"{server}/sessions/while-paused").status_code == 404
    assert _live_sessions(server) == 0


def test_one_id_is_one_episode_others_run_alongside(stack: Stack) -> None:
    """Over one base URL, a second concurrent request with the same X-Session-ID for the same conversation is that
    session's 409 (never a second trajectory, never interleaved), while other ids run at the same time. (A request
    that starts another conversation on the id is a segment of it: tests/e2e/test_server_segments.py.)"""
    server, engine = stack.server, stack.engine

    async def main() -> tuple[int, int, int]:
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            def chat(sid: str, content: str) -> Any:
                return http.post("/v1/chat/completions", headers={"X-Session-ID": sid},
                                 json={"messages": [{"role": "user", "content": content}]})
            # 6 s at the engine: the contender and another episode's whole turn come long before its end
            owner = asyncio.ensure_future(chat("race-1", "long [[sim: tokens 1200]]"))
            await wait_running(engine, 1)
            contender = await chat("race-1", "long [[sim: tokens 1200]]")
            other = await chat("race-2", "another episode [[sim: tokens 3]]")
            assert not owner.done()  # both answers came while the owner was still generating
            return (await owner).status_code, contender.status_code, other.status_code

    assert asyncio.run(main()) == (200, 409, 200)
    for sid, contents in (("race-1", ["long [[sim: tokens 1200]]"]), ("race-2", ["another episode [[sim: tokens 3]]"])):
        info = _session(server, sid)
        assert [m["content"] for m in info["messages"] if m["role"] == "user"] == contents
        assert len(info["records"]) == 1
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_a_streamed_turn_that_rolls_back_says_so_before_the_first_byte(stack: Stack) -> None:
    strict = stack["strict"]
    sid = new_session(strict)
    history = _tool_turns(strict, sid, [LOOKUP_A], compact=True)
    body = {"model": "m", "messages": history, "tools": [LOOKUP_A], "stream": True}
    with httpx.stream("POST", chat_url(strict, sid), json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-session-rollback"] == "1; reason=tool_call_arguments"
        text = resp.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    content = "".join(c["delta"].get("content") or "" for e in sse_events(text.encode()) for c in e["choices"])
    assert content == "It is 42."
    info = _session(strict, sid)
    assert info["rollbacks_by_reason"] == {"tool_call_arguments": 1} and len(info["records"]) == 1
    assert httpx.delete(f"{strict}/sessions/{sid}").status_code == 204
