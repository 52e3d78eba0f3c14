"""Every honoured OpenAI request field, end to end: the official openai client -> session-server -> sglang-sim.

Each test asks for something the field means and checks the visible effect (a constrained reply parses against its
schema, `tool_choice: required` yields a call, logprobs equal the recorded ones, `enable_thinking: false` changes
the prompt tokens) plus the training data where it matters. The engine side is checked through a recording proxy:
what the session server sent to /generate is exactly the sampling keys SGLang's OpenAI server would have sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from support.server import TOOLS, as_history, assert_engine_baseline, new_session, session_client
from support.stack import Stack, StackFactory
from trajectory import samples_from_json

FAMILY = "qwen3"
LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}},
}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
        "conditions": {"type": "string", "enum": ["sunny", "rain", "snow"]},
        "hourly": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 5},
        "alerts": {"type": "array", "items": {"$ref": "#/$defs/alert"}},
    },
    "required": ["city", "celsius", "conditions", "hourly"],
    "additionalProperties": False,
    "$defs": {"alert": {"type": "object", "properties": {"level": {"type": "integer"}}, "required": ["level"]}},
}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, proxied=("server",)) as stack:
        yield stack


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _generate_bodies(stack: Stack, since: int) -> list[dict[str, Any]]:
    assert stack.proxy is not None
    return [c["request"] for c in stack.proxy.calls[since:] if c["path"] == "/generate"]


async def _samples(server: str, sid: str) -> Any:
    async with httpx.AsyncClient(timeout=30) as http:
        sample = samples_from_json((await http.post(f"{server}/sessions/{sid}/samples")).json())[0]
        info = (await http.get(f"{server}/sessions/{sid}")).json()
        assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204
    return sample, info


def test_logprobs_equal_the_recorded_ones(stack: Stack) -> None:
    async def run() -> None:
        sid = new_session(stack.server)
        client = session_client(stack.server, sid)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me something."}]
        first = await client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=3)
        messages += [as_history(first.choices[0].message), {"role": "user", "content": "More."}]
        second = await client.chat.completions.create(model="m", messages=messages, logprobs=True)
        sample, info = await _samples(stack.server, sid)
        agent_side = [lp.logprob for r in (first, second) for lp in r.choices[0].logprobs.content]
        np.testing.assert_array_equal(np.asarray(agent_side, dtype=np.float32),
                                      sample.rollout_log_probs[sample.loss_mask == 1])
        tokens = [t for r in (first, second) for t in r.choices[0].logprobs.content]
        assert len(tokens) == first.usage.completion_tokens + second.usage.completion_tokens
        # token texts and bytes are the sampled tokens' own
        sampled_ids = sample.tokens[sample.loss_mask == 1]
        assert b"".join(bytes(t.bytes) for t in tokens[:-1]).decode("utf-8", "replace")  # decodable
        assert len(sampled_ids) == len(tokens)
        for entry in first.choices[0].logprobs.content:
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob == entry.logprob and entry.top_logprobs[0].token == entry.token
            assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                     reverse=True)
        assert all(entry.top_logprobs == [] for entry in second.choices[0].logprobs.content)
        plain = await session_client(stack.server, new_session(stack.server)).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
        assert plain.choices[0].logprobs is None
        assert first.system_fingerprint and first.system_fingerprint == plain.system_fingerprint
        assert info["records"][0]["completion_len"] == first.usage.completion_tokens

    _run(run())


def test_response_format_json_schema_and_json_object(stack: Stack) -> None:
    async def run() -> None:
        since = len(stack.proxy.calls) if stack.proxy else 0
        sid = new_session(stack.server)
        client = session_client(stack.server, sid)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris as JSON."}]
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER_SCHEMA)
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
        messages += [as_history(reply.choices[0].message), {"role": "user", "content": "Now any JSON object."}]
        obj = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                   response_format={"type": "json_object"})
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        sent = _generate_bodies(stack, since)
        assert json.loads(sent[0]["sampling_params"]["json_schema"]) == WEATHER_SCHEMA
        assert sent[1]["sampling_params"]["json_schema"] == '{"type": "object"}'
        sample, info = await _samples(stack.server, sid)
        assert len(info["records"]) == 2 and all(r["rolled_back"] == 0 for r in info["records"])
        assert int(sample.loss_mask.sum()) == reply.usage.completion_tokens + obj.usage.completion_tokens
        with pytest.raises(openai.BadRequestError, match="response_format"):
            await session_client(stack.server, new_session(stack.server)).chat.completions.create(
                model="m", messages=messages[:1], response_format={"type": "json_schema", "json_schema": {"name": "x"}})

    _run(run())


def test_tool_choice_required_named_none_and_parallel(stack: Stack) -> None:
    async def run() -> None:
        tools = [*TOOLS, LOOKUP]
        since = len(stack.proxy.calls) if stack.proxy else 0
        client = session_client(stack.server, new_session(stack.server))
        ask = [{"role": "user", "content": "Just chat with me."}]  # no directive: the model would not call a tool
        required = await client.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice="required")
        calls = required.choices[0].message.tool_calls
        assert calls and required.choices[0].finish_reason == "tool_calls"
        assert calls[0].function.name in {"add", "lookup"} and isinstance(json.loads(calls[0].function.arguments), dict)

        client = session_client(stack.server, new_session(stack.server))
        named = await client.chat.completions.create(
            model="m", tools=tools, tool_choice={"type": "function", "function": {"name": "lookup"}},
            messages=[{"role": "user", "content": 'Add. [[sim: tool_call name=add args={"a": 1, "b": 2}]]'}])
        names = [c.function.name for c in named.choices[0].message.tool_calls]
        assert names == ["lookup"]

        two = 'Both. [[sim: tool_call name=add args={"a": 1, "b": 2}]] [[sim: tool_call name=lookup args={"key": "k"}]]'
        client = session_client(stack.server, new_session(stack.server))
        both = await client.chat.completions.create(model="m", tools=tools, messages=[{"role": "user", "content": two}])
        assert [c.function.name for c in both.choices[0].message.tool_calls] == ["add", "lookup"]
        client = session_client(stack.server, new_session(stack.server))
        one = await client.chat.completions.create(model="m", tools=tools, parallel_tool_calls=False,
                                                   messages=[{"role": "user", "content": two}])
        assert [c.function.name for c in one.choices[0].message.tool_calls] == ["add"]

        sid = new_session(stack.server)
        client = session_client(stack.server, sid)
        none = await client.chat.completions.create(model="m", tools=tools, tool_choice="none",
                                                    messages=[{"role": "user", "content": two}])
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
        assert "<tool_call>" in none.choices[0].message.content  # not parsed, as in SGLang
        sent = _generate_bodies(stack, since)
        assert json.loads(sent[0]["sampling_params"]["structural_tag"])["at_least_one"] is True
        assert [s["begin"] for s in json.loads(sent[1]["sampling_params"]["structural_tag"])["structures"]] == [
            '<tool_call>\n{"name":"lookup", "arguments":']
        assert "structural_tag" not in sent[2]["sampling_params"]
        assert json.loads(sent[3]["sampling_params"]["structural_tag"])["format"]["stop_after_first"] is True
        assert "structural_tag" not in sent[4]["sampling_params"]
        _, info = await _samples(stack.server, sid)
        prompt = info["token_ids"][: info["records"][0]["prompt_len"]]
        assert "<tools>" not in _decode(stack, prompt)  # tool_choice none: the tools are not rendered

        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await session_client(stack.server, new_session(stack.server)).chat.completions.create(
                model="m", messages=ask, tool_choice="required")
        assert_engine_baseline(stack.engine)

    _run(run())


def _decode(stack: Stack, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stack.tok).decode(ids)


def test_penalties_and_logit_bias_have_their_effect(stack: Stack) -> None:
    async def run() -> None:
        ask = [{"role": "user", "content": "Talk. [[sim: tokens 40]]"}]

        async def reply(**kw: Any) -> Any:
            client = session_client(stack.server, new_session(stack.server))
            return await client.chat.completions.create(model="m", messages=ask, seed=3, logprobs=True, **kw)

        base = await reply()
        words = base.choices[0].message.content.split()
        penalised = (await reply(presence_penalty=1.5)).choices[0].message.content.split()
        assert len(set(penalised)) == len(penalised) and penalised != words
        repeated = (await reply(frequency_penalty=-1.0)).choices[0].message.content.split()
        assert len(set(repeated)) == 1
        banned_token = base.choices[0].logprobs.content[0]
        tok = _tokenizer(stack)
        token_id = tok.convert_tokens_to_ids(tok.tokenize(banned_token.token))[0]
        biased = await reply(logit_bias={str(token_id): -100})
        assert all(t.token != banned_token.token for t in biased.choices[0].logprobs.content)
        favoured = tok.encode(" lattice")[0]
        first = (await reply(logit_bias={str(favoured): 50})).choices[0].logprobs.content[0]
        assert first.token == " lattice"
        min_p = await reply(extra_body={"min_p": 0.9, "repetition_penalty": 1.0})
        assert min(t.logprob for t in min_p.choices[0].logprobs.content) >= np.log(0.9) - 1e-6
        same = await reply()
        assert same.choices[0].message.content == base.choices[0].message.content  # seed: deterministic

    _run(run())


def _tokenizer(stack: Stack) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stack.tok)


def test_enable_thinking_false_changes_the_prompt_tokens(stack: Stack) -> None:
    async def run() -> None:
        results = {}
        for thinking in (True, False):
            sid = new_session(stack.server)
            client = session_client(stack.server, sid)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Think first. [[sim: think]]"}]
            first = await client.chat.completions.create(
                model="m", messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            messages += [as_history(first.choices[0].message), {"role": "user", "content": "Again. [[sim: think]]"}]
            second = await client.chat.completions.create(
                model="m", messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            _, info = await _samples(stack.server, sid)
            assert all(r["rolled_back"] == 0 for r in info["records"])
            results[thinking] = (first, second, info)
        on_first, _, on_info = results[True]
        off_first, off_second, off_info = results[False]
        assert on_first.choices[0].message.model_dump().get("reasoning_content")
        assert not off_first.choices[0].message.model_dump().get("reasoning_content")  # the model answers at once
        assert off_first.usage.prompt_tokens > on_first.usage.prompt_tokens
        for info in (off_info,):
            for record in info["records"]:
                prompt = _decode(stack, info["token_ids"][: record["prompt_len"]])
                assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        on_prompt = _decode(stack, on_info["token_ids"][: on_info["records"][0]["prompt_len"]])
        assert on_prompt.endswith("<|im_start|>assistant\n")
        assert off_second.usage.prompt_tokens_details.cached_tokens >= off_first.usage.prompt_tokens

    _run(run())


def test_model_retrieval_and_unhonourable_fields(stack: Stack) -> None:
    async def run() -> None:
        sid = new_session(stack.server)
        client = session_client(stack.server, sid)
        listed = await client.models.list()
        model_id = listed.data[0].id
        card = await client.models.retrieve(model_id)
        assert card.id == model_id
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no-such-model")
        async with httpx.AsyncClient(timeout=10) as http:
            url = f"{stack.server}/sessions/{sid}/v1/models/..%2F..%2Fabort_request"
            assert (await http.get(url)).status_code == 404
            assert (await http.get(f"{stack.server}/sessions/{'0' * 32}/v1/models/{model_id}")).status_code == 404
            for body, field in (({"max_tokens": 2**70}, "max_tokens"), ({"logit_bias": {"1": 1e9}}, "logit_bias"),
                                ({"functions": [{"name": "f"}]}, "functions"), ({"seed": -(2**64)}, "seed")):
                resp = await http.post(f"{stack.server}/sessions/{sid}/v1/chat/completions",
                                       json={"messages": [{"role": "user", "content": "x"}], **body})
                assert resp.status_code == 400 and field in resp.json()["error"]["message"], resp.text
        assert_engine_baseline(stack.engine)

    _run(run())
