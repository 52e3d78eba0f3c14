"""Token ids on replies (session_server/frontend/token_ids.py), read as the capture-style frameworks read them: through
the official `openai` SDK's extra fields, vLLM's `prompt_token_ids` / `choices[].token_ids` on Chat Completions and
NeMo Gym's `prompt_token_ids` / `generation_token_ids` / `generation_log_probs` on the last Responses output item.

What holds: the ids are the session's stored ones (prompt + generation is what GET /sessions/{id} holds after the
turn; the prompt is the engine's input_ids, TITO's, not a re-render; the logprobs are the sample's), a later turn's
prompt starts with the earlier turn's ids, streamed equals plain, an echo of the output items with the token fields
still matches the history, the server's `--return-token-ids` turns them on for every reply and a request's own
`false` off, and a value that is not a boolean is a 400 in each API's shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from support.server import RecordingProxy, new_session, session_client, sse_events
from support.stack import Stack, StackFactory
from trajectory import samples_from_json

ASK = {"return_token_ids": True}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = 'What is the weather? [[sim: tool_call name=get_weather args={"city": "Paris"}]]'


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(servers={"server": (), "flagged": ("--return-token-ids",)}, proxied={"server"}) as s:
        yield s


def stored_ids(server: str, sid: str) -> list[int]:
    info = httpx.get(f"{server}/sessions/{sid}", timeout=30).json()
    return list(info["token_ids"])


def engine_inputs(proxy: RecordingProxy) -> list[list[int]]:
    return [call["request"]["input_ids"] for call in proxy.settled() if call["path"] == "/generate"]


def test_chat_replies_carry_the_stored_ids(stack: Stack, proxy: RecordingProxy) -> None:
    sid = new_session(stack.server)

    async def episode() -> list[Any]:
        async with session_client(stack.server, sid) as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": CALL}]
            first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, extra_body=ASK)
            call = first.choices[0].message.tool_calls[0]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
            second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, extra_body=ASK)
            return [first, second]

    first, second = asyncio.run(episode())
    inputs = engine_inputs(proxy)
    stored = stored_ids(stack.server, sid)
    samples = samples_from_json(httpx.post(f"{stack.server}/sessions/{sid}/samples", json={}, timeout=30).json())
    (sample,) = samples
    for k, reply in enumerate((first, second)):
        prompt, generated = reply.model_extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]
        assert prompt == inputs[k]  # what the engine was sent: the TITO prompt
        assert generated and stored[: len(prompt) + len(generated)] == prompt + generated
        assert reply.usage.completion_tokens == len(generated)
    p1 = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    p2 = second.model_extra["prompt_token_ids"]
    assert p2[: len(p1)] == p1  # the second prompt extends the first turn's ids: never re-rendered
    assert p2 + second.choices[0].model_extra["token_ids"] == stored == sample.tokens.tolist()


def _stream_chat(server: str, sid: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = httpx.post(f"{server}/sessions/{sid}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    return [e for e in sse_events(r.content) if isinstance(e, dict)]


def test_a_streamed_chat_carries_the_same_ids_as_the_plain_one(stack: Stack) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a story. [[sim: tokens 40]]"}], "temperature": 0,
            "max_tokens": 40, **ASK}
    plain_sid, streamed_sid = new_session(stack.server), new_session(stack.server)
    plain = httpx.post(f"{stack.server}/sessions/{plain_sid}/v1/chat/completions", json=body, timeout=60).json()
    chunks = _stream_chat(stack.server, streamed_sid, body)
    assert chunks[0]["prompt_token_ids"] == plain["prompt_token_ids"]  # vLLM's first chunk
    joined = [i for c in chunks for choice in c["choices"] for i in choice.get("token_ids") or []]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
    assert final["prompt_token_ids"] == plain["prompt_token_ids"]
    assert joined == final["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert plain["prompt_token_ids"] + joined == stored_ids(stack.server, streamed_sid)


def test_responses_items_carry_nemo_gyms_fields_and_their_echo_matches(stack: Stack) -> None:
    sid = new_session(stack.server)

    async def episode() -> tuple[Any, Any]:
        async with session_client(stack.server, sid) as client:
            first = await client.responses.create(model="m", input=CALL, tools=[
                {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}],
                extra_body=ASK)
            items = [item.model_dump(exclude_none=True) for item in first.output]
            call = next(i for i in items if i["type"] == "function_call")
            echo = [{"role": "user", "content": CALL}, *items,
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}]
            second = await client.responses.create(model="m", input=echo, extra_body=ASK)
            return first, second

    first, second = asyncio.run(episode())
    (sample,) = samples_from_json(httpx.post(f"{stack.server}/sessions/{sid}/samples", json={}, timeout=30).json())
    tokens, logprobs = sample.tokens.tolist(), sample.rollout_log_probs.tolist()
    for response in (first, second):
        *earlier, last = [item.model_dump() for item in response.output]
        assert not any("generation_token_ids" in item for item in earlier)  # on the call's last item only
        prompt, generated = last["prompt_token_ids"], last["generation_token_ids"]
        assert tokens[: len(prompt) + len(generated)] == prompt + generated
        assert last["generation_log_probs"] == pytest.approx(logprobs[len(prompt): len(prompt) + len(generated)])
    info = httpx.get(f"{stack.server}/sessions/{sid}", timeout=30).json()
    assert len(info["records"]) == 2 and info["rollbacks"] == 0  # the echo, token fields and all, matched


def test_the_server_flag_turns_them_on_and_a_request_can_turn_them_off(stack: Stack) -> None:
    server = stack["flagged"]
    body = {"messages": [{"role": "user", "content": "Hi. [[sim: tokens 5]]"}], "max_tokens": 5}
    on = httpx.post(f"{server}/sessions/{new_session(server)}/v1/chat/completions", json=body, timeout=60).json()
    off = httpx.post(f"{server}/sessions/{new_session(server)}/v1/chat/completions",
                     json={**body, "return_token_ids": False}, timeout=60).json()
    assert on["prompt_token_ids"] and len(on["choices"][0]["token_ids"]) == on["usage"]["completion_tokens"]
    assert "prompt_token_ids" not in off and "token_ids" not in off["choices"][0]
    unasked = httpx.post(f"{stack.server}/sessions/{new_session(stack.server)}/v1/chat/completions", json=body,
                         timeout=60).json()
    assert "prompt_token_ids" not in unasked and "token_ids" not in unasked["choices"][0]
    responses = httpx.post(f"{server}/sessions/{new_session(server)}/v1/responses",
                           json={"input": "Hi. [[sim: tokens 5]]", "max_output_tokens": 5}, timeout=60).json()
    assert len(responses["output"][-1]["generation_token_ids"]) == responses["usage"]["output_tokens"]


@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_a_value_that_is_not_a_boolean_is_a_400(stack: Stack, value: Any) -> None:
    sid = new_session(stack.server)
    chat = httpx.post(f"{stack.server}/sessions/{sid}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "Hi"}], "return_token_ids": value})
    assert chat.status_code == 400 and "return_token_ids" in chat.json()["error"]["message"], chat.text
    responses = httpx.post(f"{stack.server}/sessions/{sid}/v1/responses", timeout=30,
                           json={"input": "Hi", "return_token_ids": value})
    assert responses.status_code == 400 and "return_token_ids" in responses.json()["error"]["message"]
    assert httpx.get(f"{stack.server}/sessions/{sid}", timeout=30).json()["records"] == []


def test_the_sdk_refuses_nothing(stack: Stack) -> None:
    """A client that never asks sees the reply it always saw: the SDK's own parse has no extra fields."""
    sid = new_session(stack.server)

    async def ask() -> Any:
        async with session_client(stack.server, sid) as client:
            return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=4)

    reply = asyncio.run(ask())
    assert isinstance(reply, openai.types.chat.ChatCompletion) and not reply.model_extra


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_as_token_ids_names_every_logprob_by_its_id(stack: Stack, stream: bool) -> None:
    """vLLM's `return_tokens_as_token_ids`: every logprob entry, the alternatives too, is `token_id:<id>` with that
    name's bytes; the sampled ones read back as the reply's token ids, and the logprobs are those of a request that
    did not ask."""
    body = {"messages": [{"role": "user", "content": "Tell me a story. [[sim: tokens 12]]"}], "temperature": 0,
            "max_tokens": 12, "logprobs": True, "top_logprobs": 3, **ASK}
    named_sid, plain_sid = new_session(stack.server), new_session(stack.server)
    url = f"{stack.server}/sessions/{plain_sid}/v1/chat/completions"
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]["content"]
    if stream:
        chunks = _stream_chat(stack.server, named_sid, {**body, "return_tokens_as_token_ids": True})
        entries = [e for c in chunks for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content") or []]
        ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    else:
        reply = httpx.post(f"{stack.server}/sessions/{named_sid}/v1/chat/completions", timeout=60,
                           json={**body, "return_tokens_as_token_ids": True}).json()
        entries, ids = reply["choices"][0]["logprobs"]["content"], reply["choices"][0]["token_ids"]
    assert [e["token"] for e in entries] == [f"token_id:{i}" for i in ids] and len(ids) == 12
    for entry in entries:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert all(alt["token"].startswith("token_id:") and alt["token"][9:].isdigit()
                   and alt["bytes"] == list(alt["token"].encode()) for alt in entry["top_logprobs"])
    assert [e["logprob"] for e in entries] == [e["logprob"] for e in plain]
    assert not plain[0]["token"].startswith("token_id:")  # a request that did not ask gets the token texts
