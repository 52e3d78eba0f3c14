"""Multi-turn tool loops for every model family, checked token by token against what the engine really saw.

A recording proxy sits between the session server and `sglang-sim`, so the merged training sample is compared with
the `input_ids` the engine received and the `output_ids`/logprobs it generated -- not with the server's own records.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from support.families import FAMILIES, MERGES_ASSISTANT_TURNS, ONE_CALL_PER_REPLY
from support.server import (
    TOOLS,
    as_history,
    assert_engine_baseline,
    assert_sample_is_what_the_engine_saw,
    new_session,
    session_client,
)
from support.stack import Stack, StackFactory
from trajectory import samples_from_json

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


@pytest.fixture(scope="module", params=FAMILIES)
def stack(request: pytest.FixtureRequest, stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=request.param, proxied={"server"}) as stack:
        yield stack


def test_tool_loop_matches_what_the_engine_saw(stack: dict) -> None:
    server, proxy = stack["server"], stack["proxy"]
    sid = new_session(server)
    proxy.clear()
    tools = [*TOOLS, LOOKUP_TOOL]

    async def episode() -> list:
        client = session_client(server, sid)
        messages: list[dict] = [
            {"role": "system", "content": "Use the tools. Ünïcödé is fine."},
            {
                "role": "user",
                "content": 'Do two things. [[sim: think]] [[sim: tool_call name=add args={"a": 2, "b": 40}]] '
                '[[sim: tool_call name=lookup args={"key": "naïve \\"quoted\\" {nested: [1, 2]}"}]]',
            },
        ]
        replies = []
        first = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        replies.append(first)
        calls = first.choices[0].message.tool_calls
        if stack["family"] in ONE_CALL_PER_REPLY:  # the model stopped at its first call
            assert [c.function.name for c in calls] == ["add"]
        else:
            assert [c.function.name for c in calls] == ["add", "lookup"]  # parallel calls parsed
            assert json.loads(calls[1].function.arguments) == {"key": 'naïve "quoted" {nested: [1, 2]}'}
        messages.append(as_history(first.choices[0].message))
        for i, call in enumerate(calls):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42" if i + 1 < len(calls) else
                             'found [[sim: think]] [[sim: tool_call name=add args={"a": 1, "b": 1}]]'})
        second = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        replies.append(second)
        assert second.choices[0].finish_reason == "tool_calls"
        messages.append(as_history(second.choices[0].message))
        messages.append({
            "role": "tool", "tool_call_id": second.choices[0].message.tool_calls[0].id,
            "content": "2 [[sim: reply All done: 42 and 2.]]",
        })
        third = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        replies.append(third)
        assert third.choices[0].message.content == "All done: 42 and 2."
        assert third.choices[0].finish_reason == "stop"
        messages.append(as_history(third.choices[0].message))
        messages.append({"role": "user", "content": "And? [[sim: tokens 7]]"})
        replies.append(await client.chat.completions.create(model="m", messages=messages, tools=tools))
        return replies

    replies = asyncio.run(episode())
    sent = proxy.generates()
    assert len(sent) == len(replies) == 4
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples").json())[0]
    for call, reply in zip(sent, replies, strict=True):
        req = call["request"]
        assert "session_params" not in req and req["return_logprob"] is True
        assert call["routing_key"] == sid  # sticky routing through sglang-router
        assert len(req["rid"]) == 32 and reply.id == f"chatcmpl-{req['rid']}"
    spans = assert_sample_is_what_the_engine_saw(sample, sent)
    for reply, (start, end) in zip(replies, spans, strict=True):
        assert reply.usage.prompt_tokens == start and reply.usage.completion_tokens == end - start
    report = httpx.get(f"{server}/sessions/{sid}").json()["mismatch_report"]
    assert "equal" in report or "error" in report
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack["engine"])


def test_an_injected_assistant_turn_is_prompt_on_every_family(stack: dict, hf_tokenizers: dict) -> None:
    """An agent injects a canned assistant message (the model never generated it): accepted as prompt tokens with
    loss mask 0, on every family; the tokens still equal what the engine received and generated."""
    server, proxy = stack["server"], stack["proxy"]
    sid = new_session(server)
    proxy.clear()
    url = f"{server}/sessions/{sid}/v1/chat/completions"
    canned = "Sure. I checked the manual first; now the answer."
    history: list[dict] = [{"role": "user", "content": "Hello [[sim: tokens 5]]"}]
    first = httpx.post(url, json={"messages": history}, timeout=30)
    assert first.status_code == 200, first.text
    history.append(first.json()["choices"][0]["message"])
    if stack["family"] in MERGES_ASSISTANT_TURNS:  # right after the generated turn, it would join that message: 400
        refused = httpx.post(url, json={"messages": [*history, {"role": "assistant", "content": canned}]}, timeout=30)
        assert refused.status_code == 400 and "rewrites earlier messages" in refused.text, refused.text
        history.append({"role": "user", "content": "Noted."})
    history += [{"role": "assistant", "content": canned}, {"role": "user", "content": "Go on [[sim: reply Done.]]"}]
    second = httpx.post(url, json={"messages": history}, timeout=30)
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["message"]["content"] == "Done."
    info = httpx.get(f"{server}/sessions/{sid}").json()
    assert len(info["records"]) == 2 and info["rollbacks"] == 0
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples").json())[0]
    sent = proxy.generates()
    assert len(sent) == 2
    (_, first_end), (second_start, _) = assert_sample_is_what_the_engine_saw(sample, sent)
    # The canned text sits in the second prompt, between the two generated turns, entirely under mask 0.
    tokenizer = hf_tokenizers[stack["family"]]
    between = tokenizer.decode(sample.tokens[first_end:second_start].tolist())
    assert canned in between and not sample.loss_mask[first_end:second_start].any()
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack["engine"])


def _begins(node: object) -> list[str]:
    """Every tool-call `begin` of a structural tag (legacy `structures`, xgrammar's nested formats)."""
    if isinstance(node, list):
        return [b for item in node for b in _begins(item)]
    if not isinstance(node, dict):
        return []
    own = [node["begin"]] if node.get("type") in (None, "tag") and isinstance(node.get("begin"), str) else []
    return own + [b for key in ("format", "structures", "tags", "elements", "content") for b in _begins(node.get(key))]


def test_a_forced_tool_choice_is_constrained_in_the_familys_own_format(stack: dict) -> None:
    """`tool_choice` required and a named function reach the engine as a structural tag of the family's own call
    format (never the JSON-array schema that would force the model out of it), and the reply parses as the family's
    calls. tests/sglang/test_tool_grammar_oracle.py holds the tags to SGLang's own."""
    server, proxy = stack["server"], stack["proxy"]
    tools = [*TOOLS, LOOKUP_TOOL]
    ask = [{"role": "user", "content": "Just chat with me."}]  # no directive: unconstrained, the model would not call
    for choice, allowed in (("required", {"add", "lookup"}),
                            ({"type": "function", "function": {"name": "lookup"}}, {"lookup"})):
        proxy.clear()
        sid = new_session(server)
        reply = httpx.post(f"{server}/sessions/{sid}/v1/chat/completions", timeout=30,
                           json={"messages": ask, "tools": tools, "tool_choice": choice})
        assert reply.status_code == 200, reply.text
        choice_0 = reply.json()["choices"][0]
        calls = choice_0["message"]["tool_calls"]
        assert calls and choice_0["finish_reason"] == "tool_calls", choice_0
        assert {c["function"]["name"] for c in calls} <= allowed
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
        (sent,) = proxy.generates()
        sampling = sent["request"]["sampling_params"]
        assert "json_schema" not in sampling
        begins = _begins(json.loads(sampling["structural_tag"]))
        assert begins and {name for name in ("add", "lookup") if any(name in b for b in begins)} == allowed
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack["engine"])
