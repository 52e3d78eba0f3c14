"""Real streaming end to end: `stream: true` on the engine's /generate, OpenAI chunks to the agent as tokens arrive.

The sim decodes with a per-token latency, so a reply arrives in many engine events; the tests check the chunk shapes
the openai SDK consumes (role first, reasoning_content and content deltas, tool calls with their index, finish_reason,
a usage chunk with empty `choices`), that the assembled message is exactly what was committed, that logprobs equal the
recorded ones, that a failure after the first byte is an error event with nothing committed, and that a client who
hangs up mid-stream gets its engine request aborted and its slot back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from support.server import (
    TOOLS,
    assert_engine_baseline,
    chat_url,
    engine_info,
    new_session,
    session_client,
    wait_engine_idle,
)
from support.stack import Stack, StackFactory
from trajectory import samples_from_json

FAMILY = "qwen3"
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}


PER_TOKEN = ["--engine-stream-interval", "1"]


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--token-latency-ms", "4", "--enable-streaming-session", "--context-length", "4096"],
        # one engine event per token (not the server's default pacing): what is streamed is checked token by token
        servers={"server": [*PER_TOKEN], "sessions": ["--engine-sessions", *PER_TOKEN]},
    ) as stack:
        yield stack


def assemble(chunks: list[Any]) -> tuple[dict[str, Any], str | None, Any, list[Any]]:
    """What an agent rebuilds from the deltas: the message, the finish reason, usage, and logprob entries."""
    message: dict[str, Any] = {"role": None, "content": "", "reasoning_content": "", "tool_calls": {}}
    finish, usage, logprobs = None, None, []
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        message["role"] = delta.get("role", message["role"])
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            slot = message["tool_calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = call.get("id") or slot["id"]
            slot["name"] += call.get("function", {}).get("name") or ""
            slot["arguments"] += call.get("function", {}).get("arguments") or ""
        if choice.logprobs is not None and choice.logprobs.content:
            logprobs += choice.logprobs.content
        finish = choice.finish_reason or finish
    return message, finish, usage, logprobs


async def _stream(client: openai.AsyncOpenAI, **kw: Any) -> list[Any]:
    stream = await client.chat.completions.create(model="m", stream=True, **kw)
    return [chunk async for chunk in stream]


def _history(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message["reasoning_content"]:
        out["reasoning_content"] = message["reasoning_content"]
    if message["tool_calls"]:
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for _, c in sorted(message["tool_calls"].items())]
    return out


@pytest.mark.parametrize("server_name", ["server", "sessions"])
def test_streamed_tool_loop_commits_exactly_what_was_streamed(stack: Stack, server_name: str) -> None:
    async def run() -> None:
        server = stack.servers[server_name]
        sid = new_session(server)
        client = session_client(server, sid)
        tools = [*TOOLS, LOOKUP]
        messages: list[dict[str, Any]] = [{"role": "user", "content": (
            'Both. [[sim: think]] [[sim: tool_call name=add args={"a": 1, "b": 2}]] '
            '[[sim: tool_call name=lookup args={"key": "k"}]]')}]
        turns = []
        chunks = await _stream(client, messages=messages, tools=tools, logprobs=True,
                               stream_options={"include_usage": True})
        message, finish, usage, logprobs = assemble(chunks)
        assert chunks[0].choices[0].delta.role == "assistant" and finish == "tool_calls"
        assert [c["name"] for _, c in sorted(message["tool_calls"].items())] == ["add", "lookup"]
        assert sorted(message["tool_calls"]) == [0, 1]
        assert message["reasoning_content"] and message["content"] == ""
        # reasoning arrived in pieces, as it was generated
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.model_dump().get("reasoning_content")) > 1
        assert chunks[-1].choices == [] and usage.completion_tokens == len(logprobs)
        turns.append((message, usage, logprobs))
        messages.append(_history(message))
        for i, call in sorted(message["tool_calls"].items()):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {i}"})
        messages[-1]["content"] += " [[sim: tokens 300]]"  # 1.2 s: read in many pieces, however late the reads
        chunks = await _stream(client, messages=messages, tools=tools, logprobs=True,
                               stream_options={"include_usage": True})
        message, finish, usage, logprobs = assemble(chunks)
        assert finish == "stop" and len(message["content"].split()) > 5
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # many content deltas
        turns.append((message, usage, logprobs))

        async with httpx.AsyncClient(timeout=30) as http:
            info = (await http.get(f"{server}/sessions/{sid}")).json()
            sample = samples_from_json((await http.post(f"{server}/sessions/{sid}/samples")).json())[0]
            assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204
        assert len(info["records"]) == 2 and all(r["rolled_back"] == 0 for r in info["records"])
        for (streamed, usage, _), record in zip(turns, info["records"], strict=True):
            stored = record["message"]
            assert (stored.get("content") or "") == streamed["content"]
            assert (stored.get("reasoning_content") or "") == streamed["reasoning_content"]
            stored_calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
                            for c in stored.get("tool_calls") or []]
            assert stored_calls == [(c["id"], c["name"], c["arguments"])
                                    for _, c in sorted(streamed["tool_calls"].items())]
            assert record["completion_len"] == usage.completion_tokens
        streamed_lps = [lp.logprob for _, _, lps in turns for lp in lps]
        np.testing.assert_array_equal(np.asarray(streamed_lps, dtype=np.float32),
                                      sample.rollout_log_probs[sample.loss_mask == 1])
        assert int(sample.loss_mask.sum()) == sum(u.completion_tokens for _, u, _ in turns)
        assert_engine_baseline(stack.engine, open_sessions=0)

    asyncio.run(run())


def test_deltas_arrive_while_the_engine_is_still_generating(stack: Stack) -> None:
    """A reply of 3500 tokens (14 s at the engine): its first words reach the agent while the engine still generates,
    however slowly the agent reads; the agent then hangs up, which ends it."""
    async def run() -> None:
        sid = new_session(stack.server)
        client = session_client(stack.server, sid)
        stream = await client.chat.completions.create(
            model="m", stream=True, messages=[{"role": "user", "content": "Long. [[sim: tokens 3500]]"}])
        seen_running = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                seen_running = engine_info(stack.engine)["running_requests"]
                break
        await stream.close()
        assert seen_running == 1  # the first words reached the agent before the engine had finished
        wait_engine_idle(stack.engine)
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.delete(f"{stack.server}/sessions/{sid}")).status_code == 204
        assert_engine_baseline(stack.engine)

    asyncio.run(run())


def test_disconnect_mid_stream_aborts_the_engine_and_commits_nothing(stack: Stack) -> None:
    async def run() -> None:
        sid = new_session(stack.server)
        # 14 s at the engine: still generating when the client hangs up, however slow the machine
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Long. [[sim: tokens 3500]]"}]}
        aborted = engine_info(stack.engine)["aborted_requests"]
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", chat_url(stack.server, sid), json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if '"content"' in line and '"content":""' not in line:
                        break  # real content arrived: hang up now
            info = wait_engine_idle(stack.engine)
            assert info["aborted_requests"] == aborted + 1  # aborted, not finished
            # the slot is free at once and nothing was committed: the same turn can be retried immediately
            retry = await http.post(chat_url(stack.server, sid), json={**body, "stream": False, "max_tokens": 5})
            assert retry.status_code == 200, retry.text
            records = (await http.get(f"{stack.server}/sessions/{sid}")).json()["records"]
            assert len(records) == 1 and records[0]["completion_len"] == 5
            metrics = (await http.get(f"{stack.server}/metrics")).text
            assert 'session_server_aborts_total{cause="disconnect"}' in metrics
            assert (await http.delete(f"{stack.server}/sessions/{sid}")).status_code == 204
        assert_engine_baseline(stack.engine)

    asyncio.run(run())


def test_failure_after_the_first_byte_is_an_error_event_and_commits_nothing(stack: Stack) -> None:
    async def run() -> None:
        sid = new_session(stack.server)
        client = session_client(stack.server, sid)
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.post(f"{stack.engine}/sim/faults", json={"oob_token": 1.0})).status_code == 200
        try:
            got: list[Any] = []
            with pytest.raises(openai.APIError, match="token id"):
                stream = await client.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "Hi. [[sim: tokens 30]]"}])
                async for chunk in stream:
                    got.append(chunk)
            assert got and got[0].choices[0].delta.role == "assistant"  # the stream had started
        finally:
            async with httpx.AsyncClient(timeout=10) as http:
                await http.post(f"{stack.engine}/sim/faults", json={})
        await _assert_nothing_committed(stack, sid)

    asyncio.run(run())


async def _assert_nothing_committed(stack: Stack, sid: str) -> None:
    """The failed stream committed nothing; the session still deletes and the engine is back at its baseline."""
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.get(f"{stack.server}/sessions/{sid}")).json()["records"] == []
        assert (await http.delete(f"{stack.server}/sessions/{sid}")).status_code == 204
    assert_engine_baseline(stack.engine)


def test_errors_before_the_first_byte_keep_their_status(stack: Stack) -> None:
    async def run() -> None:
        sid = new_session(stack.server)
        client = session_client(stack.server, sid)
        # the engine refuses (context too long) inside its SSE stream: the agent still gets a real 400
        with pytest.raises(openai.BadRequestError, match="context length"):
            await _stream(client, messages=[{"role": "user", "content": "x"}], max_tokens=5000)
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await _stream(client, messages=[{"role": "user", "content": "x"}], tool_choice="required")
        with pytest.raises(openai.NotFoundError):
            await _stream(session_client(stack.server, "f" * 32), messages=[{"role": "user", "content": "x"}])
        await _assert_nothing_committed(stack, sid)

    asyncio.run(run())


def test_a_streaming_chat_holds_its_slot_until_the_last_byte(stack: Stack) -> None:
    async def run() -> None:
        sid = new_session(stack.server)
        # 4 s at the engine: the second request comes long before the stream's end, however slow the machine
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Long. [[sim: tokens 1000]]"}]}
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", chat_url(stack.server, sid), json=body) as resp:
                lines = resp.aiter_lines()
                first = await lines.__anext__()
                assert first.startswith("data:")
                busy = await http.post(chat_url(stack.server, sid), json={**body, "stream": False})
                assert busy.status_code == 409  # the gate still holds the streaming chat
                rest = [line async for line in lines]
            assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
            finals = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
            assert finals[-1]["choices"][0]["finish_reason"] == "length" or finals[-1]["choices"][0][
                "finish_reason"] == "stop"
            assert (await http.delete(f"{stack.server}/sessions/{sid}")).status_code == 204
        assert_engine_baseline(stack.engine)

    asyncio.run(run())


@pytest.fixture(scope="module")
def incremental(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY, sim_args=["--token-latency-ms", "2", "--incremental-streaming-output"],
        servers={"server": ["--engine-incremental-streaming", *PER_TOKEN], "cumulative": [*PER_TOKEN]},
    ) as stack:
        yield stack


def test_incremental_engine_streams_are_summed_or_refused_with_the_flag_named(incremental: Stack) -> None:
    """SGLang with --incremental-streaming-output sends deltas; the server with --engine-incremental-streaming
    sums them and commits the same turn as from cumulative events; a server without the flag refuses them (502
    naming the flag) instead of committing a fragment."""
    async def run() -> None:
        ask = [{"role": "user", "content": 'Go. [[sim: think]] [[sim: tool_call name=add args={"a": 1, "b": 2}]]'}]
        sid = new_session(incremental.server)
        chunks = await _stream(session_client(incremental.server, sid), messages=ask, tools=TOOLS, logprobs=True,
                               stream_options={"include_usage": True})
        message, finish, usage, logprobs = assemble(chunks)
        assert finish == "tool_calls" and message["reasoning_content"]
        assert [c["name"] for c in message["tool_calls"].values()] == ["add"]
        async with httpx.AsyncClient(timeout=30) as http:
            info = (await http.get(f"{incremental.server}/sessions/{sid}")).json()
            sample = samples_from_json((await http.post(f"{incremental.server}/sessions/{sid}/samples")).json())[0]
        record = info["records"][0]
        assert record["completion_len"] == usage.completion_tokens == len(logprobs)
        assert record["message"]["reasoning_content"] == message["reasoning_content"]
        np.testing.assert_array_equal(np.asarray([lp.logprob for lp in logprobs], dtype=np.float32),
                                      sample.rollout_log_probs[sample.loss_mask == 1])
        plain = await session_client(incremental.server, new_session(incremental.server)).chat.completions.create(
            model="m", messages=ask, tools=TOOLS)
        assert plain.choices[0].message.model_dump()["reasoning_content"] == message["reasoning_content"]

        cumulative = incremental.servers["cumulative"]
        sid = new_session(cumulative)
        with pytest.raises(openai.APIError, match="--engine-incremental-streaming"):
            await _stream(session_client(cumulative, sid),
                          messages=[{"role": "user", "content": "Hi [[sim: tokens 40]]"}])
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{cumulative}/sessions/{sid}")).json()["records"] == []
        assert_engine_baseline(incremental.engine)

    asyncio.run(run())


@pytest.fixture(scope="module")
def deepseek(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family="deepseek", sim_args=["--token-latency-ms", "2"],
                       servers={"server": [*PER_TOKEN]}) as stack:
        yield stack


def test_deepseek_streams_reasoning_and_special_token_tool_calls(deepseek: Stack) -> None:
    """The non-ChatML family: `<think>` reasoning and `<｜tool▁calls▁begin｜>` calls stream as deltas and assemble to
    exactly the committed message; the tool loop continues on the streamed history without a rollback."""
    async def run() -> None:
        sid = new_session(deepseek.server)
        client = session_client(deepseek.server, sid)
        messages: list[dict[str, Any]] = [{"role": "user", "content": (
            'Go. [[sim: think]] [[sim: tool_call name=add args={"a": 4, "b": 5}]] '
            '[[sim: tool_call name=lookup args={"key": "z"}]]')}]
        tools = [*TOOLS, LOOKUP]
        message, finish, _, _ = assemble(await _stream(client, messages=messages, tools=tools))
        assert finish == "tool_calls" and message["reasoning_content"]
        assert [c["name"] for _, c in sorted(message["tool_calls"].items())] == ["add", "lookup"]
        messages.append(_history(message))
        for _, call in sorted(message["tool_calls"].items()):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "done"})
        messages[-1]["content"] += " [[sim: tokens 20]]"
        second, finish, _, _ = assemble(await _stream(client, messages=messages, tools=tools))
        assert finish == "stop" and second["content"]
        async with httpx.AsyncClient(timeout=30) as http:
            info = (await http.get(f"{deepseek.server}/sessions/{sid}")).json()
            assert (await http.delete(f"{deepseek.server}/sessions/{sid}")).status_code == 204
        assert [r["rolled_back"] for r in info["records"]] == [0, 0]
        stored = info["records"][0]["message"]
        assert stored["reasoning_content"] == message["reasoning_content"]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in stored["tool_calls"]] == [
            (c["name"], c["arguments"]) for _, c in sorted(message["tool_calls"].items())]
        assert info["records"][1]["message"]["content"] == second["content"]
        assert_engine_baseline(deepseek.engine)

    asyncio.run(run())


@pytest.fixture(scope="module")
def gpt_oss(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family="gpt-oss", sim_args=["--token-latency-ms", "2"],
                       servers={"server": [*PER_TOKEN]}) as stack:
        yield stack


def test_gpt_oss_streams_its_analysis_and_answer_as_they_arrive(gpt_oss: Stack) -> None:
    """Harmony: the analysis message streams as reasoning and the final message as content, piece by piece as the
    engine generates them (a header is sent once whole, a call's commentary message once it ends); the deltas assemble
    to exactly the committed message, and usage counts the analysis in `completion_tokens_details.reasoning_tokens`
    (through its `<|end|>`), plain and streamed alike."""
    async def run() -> None:
        sid = new_session(gpt_oss.server)
        client = session_client(gpt_oss.server, sid)
        # the answer's 300 tokens take 0.6 s: read in many pieces, however late the reads
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi. [[sim: think]] [[sim: tokens 300]]"}]
        chunks = await _stream(client, messages=messages, stream_options={"include_usage": True})
        message, finish, usage, _ = assemble(chunks)
        assert finish == "stop" and message["reasoning_content"] and message["content"]
        deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
        assert sum(1 for d in deltas if d.get("reasoning_content")) > 1
        assert sum(1 for d in deltas if d.get("content")) > 1
        first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
        # the analysis came first (its last piece may share a delta with the answer's first: one read of the engine)
        assert all(not d.get("reasoning_content") for d in deltas[first_content + 1:]), deltas
        reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
        assert 0 < reasoning_tokens < usage.completion_tokens
        messages.append(_history(message))
        messages.append({"role": "user", "content": 'Now add. [[sim: tool_call name=add args={"a": 1, "b": 2}]]'})
        call, finish, _, _ = assemble(await _stream(client, messages=messages, tools=TOOLS))
        assert finish == "tool_calls" and [c["name"] for c in call["tool_calls"].values()] == ["add"]
        async with httpx.AsyncClient(timeout=30) as http:
            info = (await http.get(f"{gpt_oss.server}/sessions/{sid}")).json()
            assert (await http.delete(f"{gpt_oss.server}/sessions/{sid}")).status_code == 204
        first = info["records"][0]
        assert first["message"]["reasoning_content"] == message["reasoning_content"]
        assert first["message"]["content"] == message["content"]
        assert [r["rolled_back"] for r in info["records"]] == [0, 0]
        tokens = info["token_ids"][first["prompt_len"]:first["prompt_len"] + first["completion_len"]]
        end = AutoTokenizer.from_pretrained(gpt_oss.tok).convert_tokens_to_ids("<|end|>")
        assert reasoning_tokens == tokens.index(end) + 1  # the analysis message, its `<|end|>` included
        plain = await session_client(gpt_oss.server, new_session(gpt_oss.server)).chat.completions.create(
            model="m", messages=messages[:1])
        assert plain.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
        assert_engine_baseline(gpt_oss.engine)

    asyncio.run(run())


@pytest.fixture(scope="module")
def fast_deltas(stack_factory: StackFactory) -> Iterator[Stack]:
    """An unpaced engine streaming deltas, one event per token: a reply's events arrive faster than any reader reads,
    so what the agent gets is decided by the server's chunk rules alone (a cap of 64 tokens, so that it binds)."""
    with stack_factory(family=FAMILY, sim_args=["--incremental-streaming-output", "--context-length", "4096"],
                       servers={"server": ["--engine-incremental-streaming", *PER_TOKEN,
                                           "--stream-chunk-tokens", "64"]}) as stack:
        yield stack


def test_a_delta_stream_reaches_the_agent_in_chunks_by_the_cap_or_the_time(fast_deltas: Stack) -> None:
    """2000 tokens at one engine event per token, read a few hundred events at a time: every chunk the agent gets
    holds at most the cap's 64 tokens (its logprob entries), the events are coalesced (not relayed one by one), and
    the chunks add up to the committed reply. Then paced at 50 ms a token (/slow_down: 60 tokens take at least 3 s),
    the agent gets new text by the time rule while the engine decodes: more than the two chunks a server that waited
    for its cap would send (the first text at once, the rest with the last event). How long the gaps are is the
    rule's, asserted on a clock the test moves (test_engine_sse.py, test_engine_chunker.py)."""
    async def run() -> None:
        server = fast_deltas.server
        chunks = await _stream(session_client(server, new_session(server)), max_tokens=2000, logprobs=True,
                               messages=[{"role": "user", "content": "Go on. [[sim: tokens 2000]]"}],
                               stream_options={"include_usage": True})
        message, _, usage, logprobs = assemble(chunks)
        sizes = [len(c.choices[0].logprobs.content) for c in chunks
                 if c.choices and c.choices[0].logprobs is not None and c.choices[0].logprobs.content]
        assert usage.completion_tokens == len(logprobs) == 2000 and message["content"]
        assert max(sizes[:-1]) <= 64  # the last: the final event's rest, whole, with the closing chunk
        # coalesced, not relayed event by event (a chunk short of 64 tokens is the first, the last, or one the
        # time rule sent)
        assert len(sizes) <= 2000 // 4

        async with httpx.AsyncClient(base_url=fast_deltas.engine, timeout=30) as engine:
            await engine.post("/slow_down", json={"forward_sleep_time": 0.05})
            try:
                client = session_client(server, new_session(server))
                stream = await client.chat.completions.create(model="m", stream=True, max_tokens=60, messages=[
                    {"role": "user", "content": "Go. [[sim: tokens 60]]"}])
                texts = [chunk.choices[0].delta.content async for chunk in stream
                         if chunk.choices and chunk.choices[0].delta.content]
            finally:
                await engine.post("/slow_down", json={"forward_sleep_time": None})
        assert len(texts) > 2
        assert_engine_baseline(fast_deltas.engine)

    asyncio.run(run())
