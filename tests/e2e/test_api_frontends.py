"""The Responses and Anthropic Messages front ends end to end, with the official SDKs, over real HTTP against the
real session server and `sglang-sim`: what the tool loops in test_frameworks.py do not cover.

- `previous_response_id` chains onto the session's own trajectory (appended, nothing re-rendered), GET returns a
  committed turn's response, and another session's response id is a 404;
- one session driven through all three APIs in turn is one trajectory, exactly what the engine saw and sampled;
- a streamed reply builds exactly the object the plain reply of the same turn is;
- count_tokens is the length of the prompt the next turn gets;
- the root URL addresses a session by X-Session-ID or by the API key;
- errors come in each API's own shape: a 400 names the field, a paused server is Anthropic's 529, a failure after
  the first byte ends the stream with the API's error event and commits nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from sglang_sim.directives import THINK, tool_call
from support.server import (
    assert_engine_baseline,
    assert_training_data,
    engine_info,
    metric,
    new_session,
    wait_engine_idle,
    wait_running,
)
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
LOOKUP = {"type": "function", "name": "lookup", "description": "Look a key up.", "strict": False,
          "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}
LOOKUP_ANTHROPIC = {"name": "lookup", "description": "Look a key up.", "input_schema": LOOKUP["parameters"]}
LOOKUP_CHAT = {"type": "function", "function": {k: LOOKUP[k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--token-latency-ms", "2"],
                       servers={"server": ["--create-sessions-on-demand"]}, proxied={"server"}) as stack:
        yield stack


def responses_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)


def anthropic_client(base: str, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def _delete(server: str, sid: str) -> None:
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


# -- a client that hangs up ---------------------------------------------------------------------------------------

LONG_TURN = {  # 40 s at the engine: the client hangs up long before its end, however slow the machine
    "responses": {"input": "Long. [[sim: tokens 20000]]", "max_output_tokens": 20000},
    "messages": {"max_tokens": 20000, "messages": [{"role": "user", "content": "Long. [[sim: tokens 20000]]"}]},
}


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", sorted(LONG_TURN))
def test_a_client_that_hangs_up_aborts_the_engine_request_and_commits_nothing(
    stack: Stack, api: str, streamed: bool,
) -> None:
    """Mid-turn (plain: while the engine runs it; streamed: once real text arrived), the engine request is aborted
    by its rid, its KV freed, nothing committed, and the same turn may be retried at once."""
    server = stack.server
    sid = new_session(server)
    url = f"{server}/sessions/{sid}/v1/{api}"
    body = {"model": "m", "stream": streamed, **LONG_TURN[api]}
    aborts = metric(server, 'session_server_aborts_total{cause="disconnect"}', 0)
    aborted = engine_info(stack.engine)["aborted_requests"]

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            if streamed:
                async with http.stream("POST", url, json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if "delta" in line and "Long" not in line:
                            break  # generated text arrived: hang up now
            else:
                chat = asyncio.ensure_future(http.post(url, json=body))
                await wait_running(stack.engine, 1)
                chat.cancel()  # closes the connection mid-request
                with pytest.raises(asyncio.CancelledError):
                    await chat

    asyncio.run(main())
    info = wait_engine_idle(stack.engine, timeout=30)
    assert info["aborted_requests"] == aborted + 1  # aborted, not finished
    assert httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"] == []
    assert metric(server, 'session_server_aborts_total{cause="disconnect"}') == aborts + 1
    retry = httpx.post(url, json={**body, "stream": False, **({"max_tokens": 5} if api == "messages" else
                                                               {"max_output_tokens": 5})}, timeout=30)
    assert retry.status_code == 200, retry.text
    assert len(httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"]) == 1
    _delete(server, sid)
    assert_engine_baseline(stack.engine)


# -- Responses: stateful chaining ----------------------------------------------------------------------------------

def test_previous_response_id_chains_on_the_session_and_get_returns_the_turn(stack: Stack) -> None:
    server = stack.server
    sid, other = new_session(server), new_session(server)

    async def run() -> None:
        client = responses_client(f"{server}/sessions/{sid}/v1")
        first = await client.responses.create(
            model="m", instructions="Be brief.", tools=[LOOKUP],
            input=f"Price of apples? {THINK} {tool_call('lookup', key='price:apple')}")
        call = next(item for item in first.output if item.type == "function_call")
        assert [item.type for item in first.output] == ["reasoning", "function_call"]
        assert first.usage.output_tokens_details.reasoning_tokens > 0
        second = await client.responses.create(
            model="m", instructions="Be brief.", tools=[LOOKUP], previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "4 [[sim: reply Apples cost 4.]]"}])
        assert second.output_text == "Apples cost 4." and second.previous_response_id == first.id
        assert second.usage.input_tokens_details.cached_tokens > 0  # the engine reused the first turn's prefix
        again = await client.responses.retrieve(first.id)
        assert again.id == first.id and again.output[1].call_id == call.call_id
        # Another session's response id, or one that names no turn, is a 404 in the Responses shape.
        elsewhere = responses_client(f"{server}/sessions/{other}/v1")
        with pytest.raises(openai.NotFoundError) as missing:
            await elsewhere.responses.create(model="m", input="x", previous_response_id=first.id)
        assert missing.value.body["type"] == "invalid_request_error" and first.id in missing.value.body["message"]
        assert missing.value.body["code"] == "session_not_found"
        with pytest.raises(openai.NotFoundError):
            await elsewhere.responses.retrieve(first.id)

    asyncio.run(run())
    info = assert_training_data(stack, sid, model_calls=2)
    assert info["messages"][0] == {"role": "system", "content": "Be brief."}
    assert httpx.get(f"{server}/sessions/{other}", timeout=10).json()["records"] == []
    _delete(server, sid)
    _delete(server, other)


# -- one session, three APIs ---------------------------------------------------------------------------------------

def test_three_apis_on_one_session_append_to_one_trajectory(stack: Stack) -> None:
    """Chat Completions, then Responses (the history resent as items), then Anthropic Messages (as blocks), then
    Responses again: four turns appended to one trajectory, no rollback, samples exactly what the engine saw."""
    server = stack.server
    sid = new_session(server)
    base = f"{server}/sessions/{sid}"
    question = f"Price of apples? {THINK} {tool_call('lookup', key='price:apple')}"

    async def run() -> None:
        chat = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = (await chat.chat.completions.create(
            model="m", tools=[LOOKUP_CHAT], messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": question}])).choices[0].message
        (call,) = reply.tool_calls
        items: list[Any] = [
            {"role": "developer", "content": "Be brief."}, {"role": "user", "content": question},
            {"type": "reasoning", "id": "rs_x", "summary": [],
             "content": [{"type": "reasoning_text", "text": reply.reasoning_content}]},
            {"type": "function_call", "call_id": call.id, "name": "lookup", "arguments": call.function.arguments},
            {"type": "function_call_output", "call_id": call.id,
             "output": f"4 {THINK} {tool_call('lookup', key='quantity:apple')}"},
        ]
        second = await responses_client(f"{base}/v1").responses.create(model="m", tools=[LOOKUP], input=items)
        items += [item.model_dump(exclude_none=True) for item in second.output]
        (call2,) = [item for item in second.output if item.type == "function_call"]
        async with anthropic_client(base) as claude:
            history: list[Any] = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": reply.reasoning_content, "signature": "s"},
                    {"type": "tool_use", "id": call.id, "name": "lookup",
                     "input": json.loads(call.function.arguments)}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": items[4]["output"]}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": second.output[0].content[0].text, "signature": "s"},
                    {"type": "tool_use", "id": call2.call_id, "name": "lookup", "input": json.loads(call2.arguments)}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call2.call_id,
                                              "content": "3 [[sim: reply 4 each, 3 of them.]]"}]},
            ]
            third = await claude.messages.create(model="m", max_tokens=256, system="Be brief.",
                                                 tools=[LOOKUP_ANTHROPIC], messages=history)
        assert third.stop_reason == "end_turn" and third.content[-1].text == "4 each, 3 of them."
        items += [{"type": "function_call_output", "call_id": call2.call_id,
                   "output": "3 [[sim: reply 4 each, 3 of them.]]"},
                  {"role": "assistant", "content": third.content[-1].text},
                  {"role": "user", "content": "Thanks! [[sim: reply You are welcome.]]"}]
        fourth = await responses_client(f"{base}/v1").responses.create(model="m", tools=[LOOKUP], input=items)
        assert fourth.output_text == "You are welcome."

    asyncio.run(run())
    info = assert_training_data(stack, sid, model_calls=4)
    assert [m["role"] for m in info["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                     "assistant", "user", "assistant"]
    _delete(server, sid)


# -- streamed equals plain -----------------------------------------------------------------------------------------

def _unparsed(value: Any) -> Any:
    """Without the `parsed` fields the SDK's stream helper adds to what it assembles (its structured-output view)."""
    if isinstance(value, dict):
        return {k: _unparsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    if isinstance(value, list):
        return [_unparsed(v) for v in value]
    return value


def _unid(obj: Any, rid: str) -> Any:
    """The object without what differs between two runs of one turn: the rid (tool-call ids hold its first 24
    characters), the creation time, and how much of the prompt the engine had cached."""
    out = json.loads(json.dumps(_unparsed(obj)).replace(rid, "RID").replace(rid[:24], "RID24"))
    out.pop("created_at", None)
    usage = out["usage"]
    usage.pop("input_tokens_details", None)
    for key in ("input_tokens", "cache_read_input_tokens"):
        if "cache_read_input_tokens" in usage:
            usage.pop(key)
    return out


PROMPTS = {"calls": f"Look it up. {THINK} {tool_call('lookup', key='a')} {tool_call('lookup', key='b')}",
           "text": f"Tell me. {THINK} [[sim: tokens 24]]"}


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("api", ["responses", "messages"])
def test_the_stream_builds_the_plain_reply(stack: Stack, api: str, prompt: str) -> None:
    """The same turn (the sim is deterministic in the prompt) plain on one session and streamed on another: the
    object the stream's final event carries is the plain reply, id for id."""
    server = stack.server
    text = prompt == "text"
    prompt = PROMPTS[prompt]
    sids = [new_session(server), new_session(server)]

    async def run() -> tuple[Any, Any]:
        if api == "responses":
            plain = await responses_client(f"{server}/sessions/{sids[0]}/v1").responses.create(
                model="m", tools=[LOOKUP], input=prompt, reasoning={"effort": "high", "summary": "auto"})
            async with responses_client(f"{server}/sessions/{sids[1]}/v1").responses.stream(
                    model="m", tools=[LOOKUP], input=prompt, reasoning={"effort": "high", "summary": "auto"}) as s:
                kinds = [event.type async for event in s]
                streamed = await s.get_final_response()
            # How many deltas the reply arrives in depends on the engine's event pacing; that it streams does not.
            assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
            assert "response.output_text.delta" in kinds or not text
            return _unid(plain.model_dump(), plain.id[5:]), _unid(streamed.model_dump(), streamed.id[5:])
        async with anthropic_client(f"{server}/sessions/{sids[0]}") as a, \
                anthropic_client(f"{server}/sessions/{sids[1]}") as b:
            plain = await a.messages.create(model="m", max_tokens=512, tools=[LOOKUP_ANTHROPIC],
                                            messages=[{"role": "user", "content": prompt}])
            async with b.messages.stream(model="m", max_tokens=512, tools=[LOOKUP_ANTHROPIC],
                                         messages=[{"role": "user", "content": prompt}]) as s:
                kinds = [event.type async for event in s]
                streamed = await s.get_final_message()
        assert "thinking" in kinds and ("text" in kinds or not text)
        return _unid(plain.model_dump(), plain.id[4:]), _unid(streamed.model_dump(), streamed.id[4:])

    plain, streamed = asyncio.run(run())
    assert streamed == plain
    for sid in sids:
        _delete(server, sid)


# -- count_tokens ---------------------------------------------------------------------------------------------------

def test_count_tokens_is_the_next_prompt_length(stack: Stack) -> None:
    server = stack.server
    sid = new_session(server)
    first = [{"role": "user", "content": f"Hi. {tool_call('lookup', key='a')}"}]

    async def run() -> tuple[int, int, int]:
        async with anthropic_client(f"{server}/sessions/{sid}") as claude:
            before = (await claude.messages.count_tokens(model="m", messages=first, tools=[LOOKUP_ANTHROPIC]))
            reply = await claude.messages.create(model="m", max_tokens=64, messages=first, tools=[LOOKUP_ANTHROPIC])
            (use,) = [b for b in reply.content if b.type == "tool_use"]
            nxt = [*first, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "1"}]}]
            counted = await claude.messages.count_tokens(model="m", messages=nxt, tools=[LOOKUP_ANTHROPIC])
            await claude.messages.create(model="m", max_tokens=64, messages=nxt, tools=[LOOKUP_ANTHROPIC])
            return (before.input_tokens, counted.input_tokens,
                    reply.usage.input_tokens + reply.usage.cache_read_input_tokens)

    before, counted, first_input = asyncio.run(run())
    records = httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"]
    assert before == records[0]["prompt_len"] == first_input
    assert counted == records[1]["prompt_len"]
    _delete(server, sid)


# -- the root URL ---------------------------------------------------------------------------------------------------

def test_root_urls_name_the_session_by_header_or_api_key(stack: Stack) -> None:
    server = stack.server

    async def run() -> None:
        by_key = anthropic_client(server, api_key="episode-key-1")
        reply = await by_key.messages.create(model="m", max_tokens=32,
                                             messages=[{"role": "user", "content": "Hi [[sim: reply Hello.]]"}])
        assert reply.content[0].text == "Hello."
        await by_key.close()
        bearer = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="episode-key-2", max_retries=0)
        response = await bearer.responses.create(model="m", input="Hi [[sim: reply Hi there.]]")
        assert response.output_text == "Hi there."
        assert (await bearer.responses.retrieve(response.id)).output_text == "Hi there."
        header = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="ignored-when-the-header-is-set",
                                    max_retries=0, default_headers={"X-Session-ID": "episode-key-2"})
        again = await header.responses.create(model="m", previous_response_id=response.id,
                                              input="More? [[sim: reply No more.]]")
        assert again.output_text == "No more."

    asyncio.run(run())
    assert len(httpx.get(f"{server}/sessions/episode-key-1", timeout=10).json()["records"]) == 1
    assert len(httpx.get(f"{server}/sessions/episode-key-2", timeout=10).json()["records"]) == 2
    for sid in ("episode-key-1", "episode-key-2"):
        _delete(server, sid)


# -- errors in each API's shape -------------------------------------------------------------------------------------

def test_a_refused_field_is_a_400_that_names_it_and_neutral_fields_are_counted(stack: Stack) -> None:
    server = stack.server
    sid = new_session(server)
    ignored = 'session_server_ignored_fields_total{api="messages",field="context_management"}'
    before = metric(server, ignored, 0.0)

    async def run() -> None:
        async with anthropic_client(f"{server}/sessions/{sid}") as claude:
            with pytest.raises(anthropic.BadRequestError) as bad:
                await claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
            assert bad.value.body["error"]["type"] == "invalid_request_error"
            assert "messages[0].content[0].type" in bad.value.body["error"]["message"]
            reply = await claude.messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi [[sim: reply ok]]"}],
                extra_body={"context_management": {"edits": []}},
                extra_headers={"anthropic-beta": "context-management-2025-06-27"})
            assert reply.content[0].text == "ok"
        with pytest.raises(openai.BadRequestError) as refused:
            await responses_client(f"{server}/sessions/{sid}/v1").responses.create(
                model="m", input="x", tools=[{"type": "custom", "name": "apply_patch"}])
        assert refused.value.body["type"] == "invalid_request_error" and "tools[0].type" in refused.value.message

    asyncio.run(run())
    assert metric(server, ignored, 0.0) == before + 1
    assert len(httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"]) == 1  # nothing half-committed
    _delete(server, sid)


def test_a_paused_server_is_anthropic_overloaded_529_and_a_503_for_responses(stack: Stack) -> None:
    server = stack.server
    sid = new_session(server)
    assert httpx.post(f"{server}/admin/pause", json={"mode": "drain"}, timeout=10).status_code == 200
    try:
        messages = httpx.post(f"{server}/sessions/{sid}/v1/messages?beta=true", timeout=10,
                              json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
        assert messages.status_code == 529 and messages.headers["retry-after"]
        assert messages.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                              "message": messages.json()["error"]["message"]}}
        responses = httpx.post(f"{server}/sessions/{sid}/v1/responses", json={"model": "m", "input": "x"}, timeout=10)
        assert responses.status_code == 503 and responses.headers["retry-after"]
        assert responses.json()["error"]["code"] == "session_paused"
    finally:
        assert httpx.post(f"{server}/admin/continue", timeout=10).status_code == 200
    _delete(server, sid)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_failure_after_the_first_byte_ends_the_stream_with_the_apis_error_event(stack: Stack, api: str) -> None:
    server = stack.server
    sid = new_session(server)
    prompt = "Hi. [[sim: tokens 30]]"
    httpx.post(f"{stack.engine}/sim/faults", json={"oob_token": 1.0}, timeout=10).raise_for_status()
    try:
        if api == "responses":
            body = {"model": "m", "input": prompt, "stream": True}
            url, last = f"{server}/sessions/{sid}/v1/responses", "response.failed"
        else:
            body = {"model": "m", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": prompt}]}
            url, last = f"{server}/sessions/{sid}/v1/messages", "error"
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        events = [line.removeprefix("event: ") for line in reply.text.splitlines() if line.startswith("event: ")]
        assert len(events) > 3 and events[-1] == last, events
        payload = json.loads(reply.text.rstrip().splitlines()[-1].removeprefix("data: "))
        if api == "responses":
            assert payload["response"]["status"] == "failed" and "token id" in payload["response"]["error"]["message"]
        else:
            assert payload["error"]["type"] == "api_error" and "token id" in payload["error"]["message"]
    finally:
        httpx.post(f"{stack.engine}/sim/faults", json={}, timeout=10)
    assert httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"] == []
    _delete(server, sid)
    assert_engine_baseline(stack.engine)


# -- hostile input: the API's own 400, naming the field --------------------------------------------------------------
HOSTILE: dict[str, tuple[str, dict[str, Any], str]] = {
    "input_object": ("responses", {"input": {"role": "user"}}, "'input'"),
    "item_string": ("responses", {"input": ["hi"]}, "'input[0]'"),
    "content_number": ("responses", {"input": [{"role": "user", "content": 5}]}, "'input[0].content'"),
    "call_arguments_object": ("responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                       "arguments": {"a": 1}}]}, "'input[0].arguments'"),
    "tools_object": ("responses", {"input": "x", "tools": {"type": "function"}}, "'tools'"),
    "tool_name_number": ("responses", {"input": "x", "tools": [{"type": "function", "name": 5}]}, "'tools[0].name'"),
    "max_output_huge": ("responses", {"input": "x", "max_output_tokens": 2**40}, "'max_output_tokens'"),
    "temperature_string": ("responses", {"input": "x", "temperature": "hot"}, "'temperature'"),
    "stream_string": ("responses", {"input": "x", "stream": "yes"}, "'stream'"),
    "previous_number": ("responses", {"input": "x", "previous_response_id": 5}, "'previous_response_id'"),
    "messages_object": ("messages", {"messages": {"role": "user"}}, "'messages'"),
    "block_string": ("messages", {"messages": [{"role": "user", "content": ["hi"]}]}, "'messages[0].content[0]'"),
    "tool_use_input_string": ("messages", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]},
        "'messages[1].content[0].input'"),
    "tool_result_without_id": ("messages", {"messages": [
        {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        "'messages[0].content[0].tool_use_id'"),
    "system_number": ("messages", {"system": 5, "messages": [{"role": "user", "content": "x"}]}, "'system'"),
    "max_tokens_huge": ("messages", {"max_tokens": 2**40, "messages": [{"role": "user", "content": "x"}]},
                        "'max_tokens'"),
    "stop_sequences_number": ("messages", {"stop_sequences": 5, "messages": [{"role": "user", "content": "x"}]},
                              "'stop_sequences'"),
    "thinking_string": ("messages", {"thinking": "on", "messages": [{"role": "user", "content": "x"}]},
                        "'thinking'"),
    "top_k_huge": ("messages", {"top_k": 2**64 - 1, "messages": [{"role": "user", "content": "x"}]}, "'top_k'"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_is_the_apis_own_400_naming_the_field(stack: Stack, case: str) -> None:
    api, fields, words = HOSTILE[case]
    server = stack.server
    sid = new_session(server)
    body = {"model": "m", **({"max_tokens": 8} if api == "messages" else {}), **fields}
    reply = httpx.post(f"{server}/sessions/{sid}/v1/{api}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if api == "messages":
        assert reply.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "invalid_request_error" and error["param"] is None
    assert words in error["message"], error["message"]
    assert httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"] == []
    _delete(server, sid)
