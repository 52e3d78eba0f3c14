"""Sampling masks end to end (issue 42): session server -> sglang-sim, every API, plain and streamed.

With masks on, every engine call asks for the kept ids of each sampled token; the samples carry them as CSR over the
tokens (empty rows off the loss mask), exactly the engine's rows; a request that cannot be replayed is the API's own
400 naming the field, and nothing reaches the engine.
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

from sglang_sim.directives import tool_call
from support.server import chat_url
from support.stack import Stack, StackFactory
from trajectory import Sample, samples_from_json, samples_from_safetensors

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 20}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family="qwen3", sim_args=["--token-latency-ms", "1"], proxied={"masks", "plain"}, servers={
            "masks": ["--return-sampling-masks", "--sampling-mask-top-k", "20"], "plain": []}) as stack:
        yield stack


def session(server: str, **body: Any) -> str:
    r = httpx.post(f"{server}/sessions", json=body or None, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def samples(server: str, sid: str) -> list[Sample]:
    r = httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=30)
    assert r.status_code == 200, r.text
    st = httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=30,
                    headers={"accept": "application/octet-stream"})
    out = samples_from_json(r.json())
    again = samples_from_safetensors(st.content)  # the same rows in the binary encoding
    assert [rows(s) for s in again] == [rows(s) for s in out]
    return out


def rows(sample: Sample) -> list[list[int]] | None:
    masks = sample.sampling_masks
    return None if masks is None else [masks.row(i).tolist() for i in range(len(masks))]


def engine_rows(stack: Stack, sid: str) -> list[list[int]]:
    """Every row the engine sent for the session's requests, in order."""
    assert stack.proxy is not None
    rows: list[list[int]] = []
    for call in (c for c in stack.proxy.generates() if c["routing_key"] == sid):
        assert call["request"]["return_sampling_mask"] is True
        response = call["response"]
        rows += response["meta_info"]["output_token_sampling_mask"]
    return rows


def assert_rows(sample: Sample, engine: list[list[int]] | None = None, top_k: int = 20) -> None:
    """One row per token; a sampled token's row holds it (at most top_k ids), every other row is empty; the engine's
    sampling logprob is at least the full-vocabulary one (the kept mass is at most one)."""
    masks = sample.sampling_masks
    assert masks is not None and len(masks) == len(sample.tokens)
    got = rows(sample)
    assert got is not None
    for token, sampled, row in zip(sample.tokens.tolist(), sample.loss_mask.tolist(), got, strict=True):
        assert (token in row and 1 <= len(row) <= top_k) if sampled else row == []
    on = sample.loss_mask == 1
    assert (masks.logprobs[on] >= sample.rollout_log_probs[on] - 1e-5).all() and (masks.logprobs[~on] == 0).all()
    if engine is not None:
        assert [row for row, s in zip(got, sample.loss_mask.tolist(), strict=True) if s] == engine


def test_a_chat_tool_episode_records_the_engines_rows(stack: Stack) -> None:
    server = stack["masks"]
    sid = session(server)
    history: list[dict[str, Any]] = [{"role": "user", "content": f"Look. {tool_call('lookup', key='a')}"}]
    for turn in range(3):
        r = httpx.post(chat_url(server, sid), timeout=60, json={"messages": history, "tools": TOOLS, **SAMPLING})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        history.append({k: v for k, v in message.items() if v is not None})
        if message.get("tool_calls"):
            history.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                            "content": "found [[sim: tokens 12]]" if turn else f"again {tool_call('lookup', key='b')}"})
        else:
            history.append({"role": "user", "content": "More. [[sim: tokens 9]]"})
    (sample,) = samples(server, sid)
    assert sample.metadata["num_turns"] == 3
    assert_rows(sample, engine_rows(stack, sid))
    assert httpx.get(f"{server}/sessions/{sid}", timeout=30).json()["return_sampling_masks"] is True


def test_streamed_turns_record_what_plain_turns_record(stack: Stack) -> None:
    server = stack["masks"]
    got = []
    for stream in (False, True):
        sid = session(server)
        history: list[dict[str, Any]] = []
        for turn in range(2):
            history.append({"role": "user", "content": f"Part {turn}. [[sim: tokens 40]]"})
            body = {"messages": history, "stream": stream, "max_tokens": 60, **SAMPLING}
            with httpx.stream("POST", chat_url(server, sid), json=body, timeout=60) as r:
                assert r.status_code == 200
                raw = r.read()
            if stream:
                chunks = [json.loads(line[5:]) for line in raw.decode().splitlines()
                          if line.startswith("data:") and line.strip() != "data: [DONE]"]
                content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            else:
                content = json.loads(raw)["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": content})
        (sample,) = samples(server, sid)
        assert_rows(sample)
        got.append(sample)
    plain, streamed = got
    assert plain.tokens.tolist() == streamed.tokens.tolist()
    assert rows(plain) == rows(streamed)


def test_responses_and_messages_record_rows_the_default_top_k_bounds(stack: Stack) -> None:
    """Responses has no top_k field: the server's --sampling-mask-top-k bounds its rows; Messages names its own."""
    server = stack["masks"]

    async def run() -> None:
        sid = session(server)
        client = openai.AsyncOpenAI(base_url=f"{server}/sessions/{sid}/v1", api_key="x", max_retries=0)
        first = await client.responses.create(model="m", input="Go. [[sim: tokens 15]]", temperature=1.0, top_p=0.9)
        await client.responses.create(model="m", input="On. [[sim: tokens 15]]", top_p=0.9,
                                      previous_response_id=first.id)
        (sample,) = samples(server, sid)
        assert_rows(sample, engine_rows(stack, sid))
        assert all(c["request"]["sampling_params"]["top_k"] == 20 for c in stack.proxy.generates()  # type: ignore
                   if c["routing_key"] == sid)
        sid = session(server)
        async with anthropic.AsyncAnthropic(base_url=f"{server}/sessions/{sid}", api_key="x", max_retries=0) as claude:
            history: list[Any] = [{"role": "user", "content": "Hi. [[sim: tokens 12]]"}]
            reply = await claude.messages.create(model="m", max_tokens=40, messages=history,
                                                 extra_body={"top_p": 0.9, "top_k": 7})
            history += [{"role": "assistant", "content": reply.content[0].text},  # type: ignore[union-attr]
                        {"role": "user", "content": "And? [[sim: tokens 12]]"}]
            await claude.messages.create(model="m", max_tokens=40, messages=history,
                                         extra_body={"top_p": 0.9, "top_k": 7})
        (sample,) = samples(server, sid)
        assert_rows(sample, engine_rows(stack, sid), top_k=7)

    asyncio.run(run())


def test_unreplayable_requests_are_each_apis_400_naming_the_field(stack: Stack) -> None:
    server = stack["masks"]
    sid = session(server, return_sampling_masks=True)
    assert stack.proxy is not None
    before = len(stack.proxy.generates())

    async def run() -> None:
        chat = openai.AsyncOpenAI(base_url=f"{server}/sessions/{sid}/v1", api_key="x", max_retries=0)
        for extra, field in (({"presence_penalty": 0.5}, "'presence_penalty'"),
                             ({"logit_bias": {"11": 2}}, "'logit_bias'"),
                             ({"extra_body": {"top_k": 5000}}, "'top_k' 5000"),
                             ({"extra_body": {"repetition_penalty": 1.2}}, "'repetition_penalty'")):
            with pytest.raises(openai.BadRequestError) as err:
                await chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], **extra)
            body: Any = err.value.body
            assert body["type"] == "invalid_request_error" and body["code"] == "sampling_not_replayable", body
            assert body["message"].startswith(field), body
        with pytest.raises(openai.BadRequestError) as err:
            await chat.responses.create(model="m", input="x", extra_body={"presence_penalty": 1.0})
        assert "'presence_penalty'" in err.value.message
        async with anthropic.AsyncAnthropic(base_url=f"{server}/sessions/{sid}", api_key="x", max_retries=0) as claude:
            with pytest.raises(anthropic.BadRequestError) as bad:
                await claude.messages.create(model="m", max_tokens=8, extra_body={"top_k": 9000},
                                             messages=[{"role": "user", "content": "x"}])
            assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            assert bad.value.body["error"]["message"].startswith("'top_k' 9000")  # type: ignore[index]

    asyncio.run(run())
    assert len(stack.proxy.generates()) == before  # nothing reached the engine
    assert httpx.get(f"{server}/sessions/{sid}", timeout=30).json()["records"] == []


OVERFLOW = ("Sampling support exceeds --sampling-mask-max-tokens=4096, commonly because of cutoff ties. Lower top_k "
            "to leave more headroom or increase the server limit.")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_an_engine_abort_for_a_support_past_its_cap_is_a_clear_400(stack: Stack, stream: bool) -> None:
    """SGLang aborts a request where a token's kept set passes --sampling-mask-max-tokens (the sim's fault
    mask_overflow, halfway through the reply): a 400 plain, HTTP 200 then an error event when streamed (tokens were
    streamed before it), either way code sampling_support_overflow with SGLang's text, never a 503 to retry; nothing
    is committed and the session takes its next turn."""
    server = stack["masks"]
    sid = session(server)
    body = {"messages": [{"role": "user", "content": "Hi [[sim: tokens 16]]"}], **SAMPLING}
    assert httpx.post(f"{stack.engine}/sim/faults", json={"mask_overflow": 1.0}).status_code == 200
    try:
        r = httpx.post(chat_url(server, sid), timeout=60, json={**body, "stream": stream})
    finally:
        httpx.post(f"{stack.engine}/sim/faults", json={})
    if stream:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events[:-1])  # streamed
        error = events[-1]["error"]
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "sampling_support_overflow", error
    assert error["message"] == f"the engine aborted the reply with sampling masks on: {OVERFLOW}"
    assert "retry_after" not in error
    assert httpx.get(f"{server}/sessions/{sid}", timeout=30).json()["records"] == []
    again = httpx.post(chat_url(server, sid), timeout=60, json=body)
    assert again.status_code == 200, again.text
    (sample,) = samples(server, sid)
    assert_rows(sample)


def test_a_session_opts_in_at_creation(stack: Stack) -> None:
    """Masks off by default on the plain server; on for a session created with return_sampling_masks; a request
    without top_k on such a session is refused there (no default configured)."""
    server = stack["plain"]
    off, on = session(server), session(server, return_sampling_masks=True)
    for sid in (off, on):
        r = httpx.post(chat_url(server, sid), timeout=60, json={
            "messages": [{"role": "user", "content": "Hi [[sim: tokens 10]]"}], **SAMPLING})
        assert r.status_code == 200, r.text
    assert samples(server, off)[0].sampling_masks is None
    assert_rows(samples(server, on)[0])
    r = httpx.post(chat_url(server, on), timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "temperature": 1.0, "top_p": 0.9})
    assert r.status_code == 400 and "'top_k' is required" in r.json()["error"]["message"]
    assert httpx.post(f"{server}/sessions", json={"return_sampling_masks": "yes"}, timeout=30).status_code == 400
