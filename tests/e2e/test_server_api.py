"""Session server API against real processes: the happy path through the openai SDK, validation, limits, routes.

One `sglang-sim` and one `session-server` (qwen3) for the module; every test uses its own sessions and leaves the
engine at its baseline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from support.server import (
    TOOLS,
    as_history,
    assert_engine_baseline,
    chat_url,
    engine_info,
    new_session,
    run_in_session,
    session_client,
)
from support.stack import Stack, StackFactory
from trajectory import samples_from_json, samples_from_safetensors

FAMILY = "qwen3"
MAX_REQUEST_BYTES = 64 * 1024
CONTEXT_LENGTH = 2048


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--context-length", str(CONTEXT_LENGTH), "--routed-experts-layers", "48"],
        servers={"server": ["--max-request-bytes", str(MAX_REQUEST_BYTES), "--return-routed-experts"]},
    ) as stack:
        yield stack


def test_health_ready_and_models(stack: dict[str, str]) -> None:
    server = stack["server"]
    health = httpx.get(f"{server}/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["instance_id"]
    assert httpx.get(f"{server}/ready").status_code == 200
    sid = new_session(server)
    models = httpx.get(f"{server}/sessions/{sid}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert httpx.get(f"{server}/sessions/{'0' * 32}/v1/models").status_code == 404
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_session_ids_are_128_bit_random(stack: dict[str, str]) -> None:
    ids = {new_session(stack["server"]) for _ in range(20)}
    assert len(ids) == 20
    for sid in ids:
        assert len(sid) == 32 and int(sid, 16) >= 0
        assert httpx.delete(f"{stack['server']}/sessions/{sid}").status_code == 204


def test_tool_loop_samples_and_delete(stack: dict[str, str]) -> None:
    run_in_session(stack["server"], _tool_loop_samples_and_delete, metadata={"task": "add"})
    assert_engine_baseline(stack["engine"])


async def _tool_loop_samples_and_delete(
    server: str, sid: str, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    messages: list[dict] = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": 'Add 1 and 2. [[sim: think]] [[sim: tool_call name=add args={"a": 1, "b": 2}]]'},
    ]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, seed=7)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert choice.message.model_dump().get("reasoning_content")
    messages.append(as_history(choice.message))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "3 [[sim: reply The sum is 3.]]"})
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "The sum is 3."
    assert second.choices[0].message.tool_calls is None
    messages.append(as_history(second.choices[0].message))
    messages.append({"role": "user", "content": "Say more. [[sim: tokens 5]]"})
    third = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=3)
    assert third.choices[0].finish_reason == "length"
    assert third.usage.completion_tokens == 3
    # TITO: each turn's prompt extends the previous prompt + completion, so the engine reuses its cache.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens

    info = (await http.get(f"{server}/sessions/{sid}")).json()
    assert info["metadata"] == {"task": "add"}
    assert len(info["records"]) == 3
    assert info["num_tokens"] == third.usage.prompt_tokens + third.usage.completion_tokens
    # The heavy replay payload is kept in the records, never sent to the agent.
    assert all("routed_experts" not in record for record in info["records"])
    # base64 int32 [positions, 48 layers, 8 experts] of the positions this turn added (routed_experts_start_len)
    assert all(record["routed_experts_bytes"] > 48 * 8 * 4 for record in info["records"])
    assert "routed_experts" not in first.model_dump_json()

    as_json = samples_from_json((await http.post(f"{server}/sessions/{sid}/samples")).json())
    raw = await http.post(f"{server}/sessions/{sid}/samples", headers={"Accept": "application/octet-stream"})
    assert raw.headers["content-type"] == "application/octet-stream"
    as_st = samples_from_safetensors(raw.content)
    assert len(as_json) == len(as_st) == 1
    sample = as_json[0]
    np.testing.assert_array_equal(sample.tokens, np.asarray(info["token_ids"], dtype=np.int32))
    np.testing.assert_array_equal(sample.tokens, as_st[0].tokens)
    np.testing.assert_array_equal(sample.loss_mask, as_st[0].loss_mask)
    sampled = sum(r.usage.completion_tokens for r in (first, second, third))
    assert int(sample.loss_mask.sum()) == sampled
    assert np.all(sample.rollout_log_probs[sample.loss_mask == 0] == 0.0)
    assert sample.status == "truncated"
    cut = samples_from_json((await http.post(f"{server}/sessions/{sid}/samples", json={"max_seq_len": 40})).json())
    assert len(cut[0].tokens) <= 40

    assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204
    assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 404
    assert (await http.get(f"{server}/sessions/{sid}")).status_code == 404
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="m", messages=messages)


def test_streaming_with_the_sdk(stack: dict[str, str]) -> None:
    run_in_session(stack["server"], _streaming_with_the_sdk)


async def _streaming_with_the_sdk(server: str, sid: str, client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": 'go [[sim: tool_call name=add args={"a": 2, "b": 5}]]'}]
    stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"  # real streaming (tests/e2e/test_server_streaming.py)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    delta = chunks[[bool(c.choices[0].delta.tool_calls) for c in chunks].index(True)].choices[0].delta
    assert delta.tool_calls[0].function.name == "add"
    assert json.loads(delta.tool_calls[0].function.arguments) == {"a": 2, "b": 5}
    # Errors before the stream keep their status: an unknown session is a 404, not an SSE error event.
    missing = session_client(server, "f" * 32)
    with pytest.raises(openai.NotFoundError):
        await missing.chat.completions.create(model="m", messages=messages, stream=True)
    # The committed turn is the streamed one.
    info = (await http.get(f"{server}/sessions/{sid}")).json()
    assert info["records"][0]["message"]["tool_calls"][0]["id"] == delta.tool_calls[0].id
    assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204


BAD_BODIES = {
    "malformed_json": b'{"messages": [',
    "not_an_object": b"[1, 2]",
    "no_messages": b'{"model": "m"}',
    "empty_messages": b'{"messages": []}',
    "message_not_object": b'{"messages": ["hi"]}',
    "role_missing": b'{"messages": [{"content": "hi"}]}',
    "unknown_role": b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    "n_two": b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}',
    "bad_max_tokens": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}',
    "bad_temperature": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
    "stream_not_bool": b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    "seed_too_big": b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}',
    "tools_not_a_list": b'{"messages": [{"role": "user", "content": "hi"}], "tools": "calc"}',
    "tool_without_function": b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
    "seed_not_int": b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}',
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_bad_requests_are_400_and_release_the_slot(stack: dict[str, str], case: str) -> None:
    server = stack["server"]
    sid = new_session(server)
    before = engine_info(stack["engine"])["finished_requests"]
    resp = httpx.post(chat_url(server, sid), content=BAD_BODIES[case], headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request" and error["message"]
    assert engine_info(stack["engine"])["finished_requests"] == before  # never reached the engine
    ok = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi [[sim: tokens 4]]"}]})
    assert ok.status_code == 200, ok.text
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_an_injected_assistant_message_is_prompt(stack: dict[str, str]) -> None:
    """An agent that injects a canned assistant turn: accepted, its tokens are prompt (loss mask 0)."""
    server = stack["server"]
    sid = new_session(server)
    history = [{"role": "user", "content": "hi [[sim: tokens 4]]"}]
    first = httpx.post(chat_url(server, sid), json={"messages": history})
    assert first.status_code == 200
    history.append(first.json()["choices"][0]["message"])
    history.append({"role": "assistant", "content": "I speak twice"})
    history.append({"role": "user", "content": "go on [[sim: tokens 3]]"})
    resp = httpx.post(chat_url(server, sid), json={"messages": history})
    assert resp.status_code == 200, resp.text
    info = httpx.get(f"{server}/sessions/{sid}").json()
    assert len(info["records"]) == 2 and info["rollbacks"] == 0
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples").json())[0]
    expected = np.zeros(len(sample.tokens), dtype=np.uint8)
    for record in info["records"]:
        expected[record["prompt_len"]:record["prompt_len"] + record["completion_len"]] = 1
    np.testing.assert_array_equal(sample.loss_mask, expected)
    assert sum(expected) == 4 + 1 + 3 + 1  # the two replies and their stop tokens, nothing of the canned turn
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def _rollbacks(metrics: httpx.Response) -> dict[str, int]:
    prefix = 'session_server_rollbacks_total{reason="'
    return {
        line[len(prefix):].split('"', 1)[0]: int(float(line.rsplit(" ", 1)[1]))
        for line in metrics.text.splitlines() if line.startswith(prefix)
    }


def test_rollback_one_turn_and_refuse_deeper_divergence(stack: dict[str, str]) -> None:
    run_in_session(stack["server"], _rollback_one_turn_and_refuse_deeper_divergence)


async def _rollback_one_turn_and_refuse_deeper_divergence(
    server: str, sid: str, client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    call = '[[sim: tool_call name=add args={"a": 1, "b": 1}]]'
    messages: list[dict] = [{"role": "user", "content": f"add twice {call}"}]
    r1 = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    messages.append(as_history(r1.choices[0].message))
    tool_id = r1.choices[0].message.tool_calls[0].id
    messages.append({"role": "tool", "tool_call_id": tool_id, "content": f"2 {call}"})
    r2 = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    turn2 = (await http.get(f"{server}/sessions/{sid}")).json()
    assert len(turn2["records"]) == 2

    # Retry the last turn with a different tool result: one checkpoint rolled back, then the new turn committed.
    retry = [*messages[:-1], {"role": "tool", "tool_call_id": tool_id, "content": "two [[sim: reply ok]]"}]
    rollbacks_before = _rollbacks(await http.get(f"{server}/metrics"))
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=retry, tools=TOOLS)
    assert raw.headers["x-session-rollback"] == "1; reason=content"  # the turn that rolled back says so
    r2b = raw.parse()
    expected = {**rollbacks_before, "content": rollbacks_before["content"] + 1}
    assert _rollbacks(await http.get(f"{server}/metrics")) == expected
    assert r2b.choices[0].message.content == "ok"
    after = (await http.get(f"{server}/sessions/{sid}")).json()
    assert len(after["records"]) == 2 and after["records"][1]["rolled_back"] == 1
    assert after["records"][1]["rollback_reason"] == "content" and after["rollbacks_by_reason"] == {"content": 1}
    first_turn_len = turn2["checkpoints"][0]["num_tokens"]
    assert after["token_ids"][:first_turn_len] == turn2["token_ids"][:first_turn_len]

    # Diverging before the first turn would drop two checkpoints: a new segment (a 400 under --on-divergence reject,
    # tests/e2e/test_server_segments.py); the first segment is unchanged.
    deeper = [{"role": "user", "content": "something else entirely [[sim: reply fine]]"}]
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=deeper, tools=TOOLS)
    assert raw.headers["x-session-segment"] == "1; started; reason=new_conversation; parent=0; branch_turn=2"
    now = (await http.get(f"{server}/sessions/{sid}")).json()

    def first_segment(info: dict) -> dict:
        return {k: v for k, v in info.items() if "segment" not in k and k != "nbytes"}

    assert first_segment(now) == first_segment(after)
    assert r2.choices[0].message is not None
    assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204


def test_request_body_limit_is_413(stack: dict[str, str]) -> None:
    server = stack["server"]
    sid = new_session(server)
    huge = {"messages": [{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 10)}]}
    resp = httpx.post(chat_url(server, sid), json=huge)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: the limit is enforced while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 2):
            yield b"y" * 1024
        yield b'"}]}'

    resp = httpx.post(chat_url(server, sid), content=chunks())
    assert resp.status_code == 413
    ok = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi [[sim: tokens 3]]"}]})
    assert ok.status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


@pytest.mark.parametrize(
    ("method", "suffix"),
    [
        ("POST", "/generate"),
        ("POST", "/v1/generate"),
        ("POST", "/abort_request"),
        ("POST", "/v1/abort_request"),
        ("GET", "/server_info"),
        ("GET", "/v1/server_info"),
        ("POST", "/v1/completions"),
        ("POST", "/flush_cache"),
        ("GET", "/v1/models/../../flush_cache"),
    ],
)
def test_session_url_reaches_no_engine_path(stack: dict[str, str], method: str, suffix: str) -> None:
    server = stack["server"]
    sid = new_session(server)
    resp = httpx.request(method, f"{server}/sessions/{sid}{suffix}", json={})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == 404
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_unknown_session_is_404_on_every_route(stack: dict[str, str]) -> None:
    server, sid = stack["server"], "ab" * 16
    assert httpx.get(f"{server}/sessions/{sid}").status_code == 404
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 404
    assert httpx.post(f"{server}/sessions/{sid}/samples").status_code == 404
    resp = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "session_not_found"


def test_reply_headers_are_not_duplicated(stack: dict[str, str]) -> None:
    server = stack["server"]
    sid = new_session(server)
    resp = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi [[sim: tokens 3]]"}]})
    assert resp.status_code == 200
    names = [k.lower() for k, _ in resp.headers.multi_items()]
    assert len(names) == len(set(names)), names
    assert "transfer-encoding" not in names and names.count("content-length") == 1
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_engine_400_passes_through_unrecorded(stack: dict[str, str]) -> None:
    server = stack["server"]
    sid = new_session(server)
    too_long = {"messages": [{"role": "user", "content": "word " * (CONTEXT_LENGTH + 100)}]}
    resp = httpx.post(chat_url(server, sid), json=too_long)
    assert resp.status_code == 400, resp.text
    assert "context" in resp.text.lower() or "tokens" in resp.text.lower()
    assert httpx.get(f"{server}/sessions/{sid}").json()["records"] == []
    ok = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi [[sim: tokens 3]]"}]})
    assert ok.status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_sampling_fields_reach_the_engine(stack: dict[str, str]) -> None:
    server = stack["server"]
    sid = new_session(server)
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 6,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "logit_bias": {"1": 2},  # irrelevant fields are ignored
        "n": 1,
    }
    first = httpx.post(chat_url(server, sid), json=body).json()
    assert first["usage"]["completion_tokens"] <= 6
    assert first["object"] == "chat.completion" and first["choices"][0]["message"]["role"] == "assistant"
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    # Same prompt and seed on a fresh session: the deterministic engine gives the same reply.
    sid2 = new_session(server)
    again = httpx.post(chat_url(server, sid2), json=body).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"] | {
        "tool_calls": again["choices"][0]["message"].get("tool_calls")
    } or again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert httpx.delete(f"{server}/sessions/{sid2}").status_code == 204


def test_sessions_are_independent_under_concurrency(stack: dict[str, str]) -> None:
    asyncio.run(_sessions_are_independent_under_concurrency(stack))


async def _sessions_are_independent_under_concurrency(stack: dict[str, str]) -> None:
    server = stack["server"]
    sids = [new_session(server) for _ in range(8)]

    async def episode(http: httpx.AsyncClient, sid: str) -> int:
        async with session_client(server, sid) as client:
            messages: list[dict] = [{"role": "user", "content": f"session {sid} [[sim: tokens 8]]"}]
            for _ in range(3):
                reply = await client.chat.completions.create(model="m", messages=messages)
                messages.append(as_history(reply.choices[0].message))
                messages.append({"role": "user", "content": "again [[sim: tokens 8]]"})
        return len((await http.get(f"{server}/sessions/{sid}")).json()["records"])

    async with httpx.AsyncClient(timeout=30) as http:
        assert await asyncio.gather(*(episode(http, s) for s in sids)) == [3] * 8
        for sid in sids:
            assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204
    assert_engine_baseline(stack["engine"])


@pytest.mark.parametrize(
    ("body", "rest", "raw"),
    [
        (b'{"meta_info":{"x":2,"routed_experts": [[1,2],[3]] ,"y":"z"}}',
         b'{"meta_info":{"x":2,"routed_experts": null ,"y":"z"}}', b"[[1,2],[3]]"),
        (b'{"meta_info":{"routed_experts":[[[1]]]}}', b'{"meta_info":{"routed_experts":null}}', b"[[[1]]]"),
        (b'{"meta_info":{"routed_experts":"AQAAAAIAAAA=","id":"r"}}', b'{"meta_info":{"routed_experts":null,"id":"r"}}',
         b"AQAAAAIAAAA="),  # SGLang's shape: a base64 string
        (b'{"meta_info":{"routed_experts": "AQAA"}}', b'{"meta_info":{"routed_experts": null}}', b"AQAA"),
        (b'{"meta_info":{"routed_experts":"AQAA', None, None),  # truncated: left to the full decoder
        (b'{"meta_info":{"routed_experts":null}}', None, None),  # nothing to cut
        (b'{"meta_info":{"routed_experts":[["a"]]}}', None, None),  # not numbers: left to the full decoder
        (b'{"meta_info":{"routed_experts":[[1,2],[3]', None, None),  # truncated: left to the full decoder
        (b'{"meta_info":{"routed_experts":[{"a":1}]}}', None, None),
        (b'{"text":"\\"routed_experts\\": [1]","meta_info":{}}', None, None),  # generated text cannot forge it
    ],
)
def test_routed_experts_are_cut_out_before_decoding(body: bytes, rest: bytes | None, raw: bytes | None) -> None:
    from session_server.engine.wire import split_routed_experts

    small, cut = split_routed_experts(body)
    assert (small, None if cut is None else bytes(cut)) == (rest if rest is not None else body, raw)


def test_an_odd_routed_experts_payload_is_still_decoded_strictly(hf_tokenizers: dict[str, object]) -> None:
    import msgspec

    from session_server.chat.serving import CHAT
    from session_server.turns.output import decode_turn
    from session_server.turns.turn import Turn
    from trajectory import LinearTrajectory, get_family

    family = get_family(FAMILY, hf_tokenizers[FAMILY])
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3, "completion_tokens": 1,
            "output_token_logprobs": [[-0.5, 11, None]], "cached_tokens": 0}
    for experts in ([[1, 2], [3]], [[1], "x"], [{"a": 1}]):
        body = msgspec.json.encode({"text": "a", "output_ids": [11], "meta_info": {**meta, "routed_experts": experts}})
        out = decode_turn(body, family, "r" * 32)
        assert msgspec.json.decode(bytes(out.result.routed_experts)) == experts
        chat = CHAT.parse(b'{"messages": [{"role": "user", "content": "hi"}]}', LinearTrajectory(family))
        assert b"routed_experts" not in CHAT.reply(Turn(chat, None, "r" * 32, "m", family), out)  # type: ignore[arg-type]
