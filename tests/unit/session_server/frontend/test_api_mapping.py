"""The Responses and Anthropic Messages front ends map onto the chat turn losslessly, with real tokenizers.

Random multi-turn episodes (support/tito.py) are played through a trajectory; every turn's history is then carried
by each API the way its client carries it -- our own replies echoed back as the client received them (output items,
content blocks), the other messages as the API's items -- and mapped back. It must match the stored history with
no rollback, and render to exactly the template tokens of the same turn carried by Chat Completions. Streams built
from the chat deltas of any chunking end as the plain reply of the same turn. Refused fields name themselves.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_server.frontend.reply_facts import ReplyFacts, reply_facts
from session_server.messages.protocol import parse_messages
from session_server.messages.reply import MessageBuilder, message_body
from session_server.responses.protocol import decode_reasoning_state, parse_responses
from session_server.responses.reply import ResponseBuilder, response_body
from session_server.turns.deltas import DeltaTracker
from support.examples import examples
from support.tito import Reply, conversations, generate
from trajectory import LinearTrajectory, ModelFamily, normalize_messages
from trajectory.errors import RequestValidationError

SETTINGS = settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
FACTS = ReplyFacts("stop", None, 10, 4, 5, 0)


# -- a client's view of a history, in each API -------------------------------------------------------------------

def responses_input(family: ModelFamily, history: list[dict[str, Any]], records: dict[int, Any]) -> list[Any]:
    """The history as a stateless Responses client resends it: our output items for generated turns (as received,
    reasoning only as `encrypted_content`, like Codex), items for the rest."""
    items: list[Any] = []
    for i, message in enumerate(history):
        role = message["role"]
        if i in records:
            result, rid = records[i]
            turn = parse_responses({"input": "x", "include": ["reasoning.encrypted_content"]}, family.thinking_switch)
            body = response_body(rid, "m", 0, turn, message, reply_facts(family, result, message))
            for item in body["output"]:
                if item["type"] == "reasoning":
                    item = {k: v for k, v in item.items() if k != "content"}
                items.append(item)
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"]})
        elif role == "assistant":
            raise AssertionError("only generated assistant turns in these episodes")
        else:
            items.append({"type": "message", "role": "developer" if role == "system" else role,
                          "content": [{"type": "input_text", "text": message["content"]}]})
    return items


def anthropic_messages(family: ModelFamily, history: list[dict[str, Any]], records: dict[int, Any]) -> dict[str, Any]:
    """The history as an Anthropic client sends it: `system`, our content blocks for generated turns, tool results
    as blocks of the next user message."""
    system = None
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(history):
        role = message["role"]
        if i in records:
            result, rid = records[i]
            body = message_body(rid, "m", message, reply_facts(family, result, message))
            messages.append({"role": "assistant", "content": body["content"]})
        elif role == "system" and i == 0:
            system = [{"type": "text", "text": message["content"], "cache_control": {"type": "ephemeral"}}]
        elif role == "system":
            messages.append({"role": "system", "content": message["content"]})
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": message["content"]}
            if messages and messages[-1]["role"] == "user" and messages[-1]["content"][-1]["type"] == "tool_result":
                messages[-1]["content"].append(block)
            else:
                messages.append({"role": "user", "content": [block]})
        else:
            text = {"type": "text", "text": message["content"]}
            if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
                messages[-1]["content"].append(text)
            else:
                messages.append({"role": "user", "content": [text]})
    request: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": messages}
    if system is not None:
        request["system"] = system
    return request


def _render(family: ModelFamily, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    return family.encode(family.render(messages, tools, add_generation_prompt=True))


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@SETTINGS
@given(data=st.data())
def test_every_api_carries_a_history_to_the_same_match_and_tokens(families, name, data):
    family = families[name]
    tools, turns = data.draw(conversations(family, reasoning=True))
    traj = LinearTrajectory(family)
    records: dict[int, Any] = {}
    for k, turn in enumerate(turns):
        request = [*traj.messages, *turn.appended]
        chat_form = normalize_messages(request)
        for api in ("responses", "anthropic"):
            if api == "responses":
                mapped = parse_responses({"input": responses_input(family, request, records)},
                                         family.thinking_switch).chat["messages"]
            else:
                if request[0]["role"] != "system" and any(m["role"] == "system" for m in request):
                    continue  # a leading user turn then a system message: Anthropic puts system first
                mapped = parse_messages(anthropic_messages(family, request, records),
                                        family.thinking_switch).chat["messages"]
            _, matched, reason = traj.matcher.match_detail(traj.messages, mapped)
            assert (matched, reason) == (len(traj.messages), None), (api, mapped)
            mine = normalize_messages(mapped)
            # Stored reasoning the client echoed is the same text; either way the appended messages are equal.
            assert mine[len(traj.messages):] == chat_form[len(traj.messages):], api
            if k == 0:
                assert _render(family, mine, tools) == _render(family, chat_form, tools), api
        plan = traj.prepare(request, tools)
        result, reply = generate(family, plan, turn.reply, rid=f"r{k}")
        traj.commit(plan, result, reply)
        records[len(traj.messages) - 1] = (result, f"r{k}")


# -- streams build the plain reply -------------------------------------------------------------------------------

def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    return [text[:p] for p in points]


@pytest.mark.parametrize("name", ["qwen3", "deepseek"])
@SETTINGS
@given(data=st.data())
def test_streamed_events_build_the_plain_reply(families, name, data):
    from support.tito import replies

    family = families[name]
    reply: Reply = data.draw(replies(family, reasoning=True).filter(lambda r: r.stop == "eos"))
    text = family.format_completion(reply.content, reply.reasoning, list(reply.tool_calls))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    message = family.parse_completion(text).to_message("call_r0")
    facts = FACTS
    turn = parse_responses({"input": "x", "reasoning": {"summary": "auto"}}, family.thinking_switch)
    tracker = DeltaTracker(family, "call_r0")
    rb, mb = ResponseBuilder("r0", "m", 0, turn), MessageBuilder("r0", "m")
    rb.start()
    mb.start(10)
    for prefix in _chunks(text, cuts):
        delta = tracker.update(prefix)
        rb.delta(delta)
        mb.delta(delta)
    rest = tracker.finish(message)
    rb.finish(rest, facts)
    mb.finish(rest, facts)
    content_after_call = bool(message.get("tool_calls")) and not text.rstrip().endswith(
        family.tool_call_markers[1] if family.tool_call_markers else "")
    if not content_after_call:
        assert rb.final == response_body("r0", "m", 0, turn, message, facts)
        assert mb.final == message_body("r0", "m", message, facts)
    # Whatever the order of the blocks, the echo is the stored message.
    echoed = parse_messages({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": mb.final["content"]}]}, None)
    assert LinearTrajectory(family).matcher.equal(message, normalize_messages(echoed.chat["messages"])[1])


def test_stream_event_sequence_is_the_documented_one(families):
    family = families["qwen3"]
    message = {"role": "assistant", "content": "Let me look.", "reasoning_content": "think",
               "tool_calls": [{"id": "call_r_0", "type": "function",
                               "function": {"name": "lookup", "arguments": '{"key": "a"}'}}]}
    turn = parse_responses({"input": "x", "include": ["reasoning.encrypted_content"]}, family.thinking_switch)
    builder = ResponseBuilder("r", "m", 0, turn)
    events = [*builder.start(), *builder.delta({"reasoning_content": "think"}), *builder.delta({"content": "Let "}),
              *builder.finish({"content": "me look.", "tool_calls": [{**message["tool_calls"][0], "index": 0}]},
                              ReplyFacts("tool_calls", None, 7, 0, 9, 3))]
    payloads = [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    assert all(e.startswith(b"event: " + p["type"].encode() + b"\n") for e, p in zip(events, payloads, strict=True))
    final = payloads[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert decode_reasoning_state(final["output"][0]["encrypted_content"]) == "think"
    assert final["output"][2]["call_id"] == "call_r_0"
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 0}

    mb = MessageBuilder("r", "m")
    events = [*mb.start(7), *mb.delta({"reasoning_content": "think"}), *mb.delta({"content": "Let me look."}),
              *mb.finish({"tool_calls": [{**message["tool_calls"][0], "index": 0}]},
                         ReplyFacts("tool_calls", None, 7, 5, 9, 3))]
    names = [e.split(b"\n", 1)[0].removeprefix(b"event: ").decode() for e in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert mb.final["stop_reason"] == "tool_use"
    assert mb.final["usage"]["input_tokens"] == 2 and mb.final["usage"]["cache_read_input_tokens"] == 5
    assert mb.final["content"][2] == {"type": "tool_use", "id": "call_r_0", "name": "lookup", "input": {"key": "a"}}


# -- fields ------------------------------------------------------------------------------------------------------

def test_responses_fields_map_onto_the_chat_request():
    turn = parse_responses({
        "model": "m", "instructions": "be brief", "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi "},
                                                            {"type": "input_text", "text": "there"}]}],
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"},
                   "strict": False}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False, "max_output_tokens": 32,
        "temperature": 0.5, "top_p": 0.9, "reasoning": {"effort": "none"}, "stream": True, "store": False,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True},
                 "verbosity": "low"},
        "include": ["reasoning.encrypted_content"], "metadata": {"k": "v"}, "prompt_cache_key": "abc",
    }, "enable_thinking")
    assert turn.chat == {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                    "parameters": {"type": "object"}, "strict": False}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False,
        "max_tokens": 32, "temperature": 0.5, "top_p": 0.9,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"},
                                                                   "strict": True}},
        "chat_template_kwargs": {"enable_thinking": False}, "stream": True, "model": "m",
    }
    assert turn.encrypted_reasoning
    assert sorted(turn.ignored) == ["metadata", "prompt_cache_key", "store", "text.verbosity"]


def test_previous_response_id_appends_to_the_stored_history():
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"},
               {"role": "assistant", "content": "a"}]
    turn = parse_responses({"input": "next", "instructions": "old", "previous_response_id": "resp_x"}, None,
                           history)
    assert turn.chat["messages"] == [*history, {"role": "user", "content": "next"}]
    assert turn.previous_response_id == "resp_x"
    turn = parse_responses({"input": "next", "instructions": "new"}, None, history)
    assert turn.chat["messages"][0] == {"role": "system", "content": "new"}


def test_messages_fields_map_onto_the_chat_request():
    turn = parse_messages({
        "model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "a", "cache_control": {}},
                                                    {"type": "text", "text": "b"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stop_sequences": ["END"],
        "temperature": 1, "top_k": 5, "thinking": {"type": "enabled", "budget_tokens": 2048}, "stream": True,
        "metadata": {"user_id": "{\"session\": 1}"}, "context_management": {"edits": []},
        "output_config": {"effort": "high"},
    }, "enable_thinking")
    assert turn.chat == {
        "messages": [{"role": "system", "content": "a\nb"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"type": "function", "function": {"name": "Bash", "description": "run",
                                                    "parameters": {"type": "object"}}}],
        "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 100, "temperature": 1,
        "top_k": 5, "stop": ["END"], "chat_template_kwargs": {"enable_thinking": True}, "stream": True,
        "model": "m",
    }
    assert turn.ignored == ["cache_control", "context_management", "metadata", "output_config.effort",
                            "thinking.budget_tokens", "tools.cache_control"]


def test_tool_results_and_text_keep_their_order():
    turn = parse_messages({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                          {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "out"}],
             "is_error": True},
            {"type": "text", "text": "and?"}]},
    ]}, None)
    assert normalize_messages(turn.chat["messages"]) == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "reasoning_content": "t", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
        {"role": "user", "content": "and?"},
    ]


@pytest.mark.parametrize(("body", "field"), [
    ({"input": 3}, "'input'"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
     "'input[0].content[0]'"),
    ({"input": [{"type": "message", "role": "system", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "'input[0].content[0]'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'input[0].type'"),
    ({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, "'tools[0].type'"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "custom"}]}]},
     "'tools[0].tools[0].type'"),
    ({"input": "x", "include": ["file_search_call.results"]}, "'include'"),
    ({"input": "x", "background": True}, "'background'"),
    ({"input": "x", "truncation": "auto"}, "'truncation'"),
    ({"input": "x", "max_output_tokens": 0}, "'max_output_tokens'"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "'text.format.type'"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "'reasoning.effort'"),
    ({"input": "x", "frobnicate": 1}, "'frobnicate'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "'input[0].call_id'"),
])
def test_responses_refusals_name_the_field(body, field):
    with pytest.raises(RequestValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_responses(body, "enable_thinking")


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "'max_tokens'"),
    ({"max_tokens": 1, "messages": []}, "'messages'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "'messages[0].content[0].source.type'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "'messages[0].content[0].type'"),
    ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "'messages[0].content[0].type'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "bash_20250124",
                                                                                 "name": "bash"}]},
     "'tools[0].type'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "all"}},
     "'tool_choice.type'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "on"}},
     "'thinking.type'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []}, "'mcp_servers'"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "'frobnicate'"),
    ({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, "'messages[0].role'"),
])
def test_messages_refusals_name_the_field(body, field):
    with pytest.raises(RequestValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_messages({"model": "m", **body}, "enable_thinking")


def test_count_tokens_needs_no_max_tokens_and_a_family_without_a_switch_ignores_thinking():
    turn = parse_messages({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "thinking": {"type": "disabled"}}, None, count_only=True)
    assert "chat_template_kwargs" not in turn.chat and turn.ignored == ["thinking"]


def test_reasoning_tokens_count_up_to_the_closing_marker(families):
    family = families["qwen3"]
    text = family.format_completion("answer", "some thought", [])
    ids = np.asarray([*family.encode(text), family.eos_token_id])
    close = family.encode("</think>")[0]
    expected = ids.tolist().index(close) + 1
    result = type("R", (), {"finish_reason": {"type": "stop", "matched": family.eos_token_id}, "prompt_tokens": 3,
                            "cached_tokens": 0, "completion_tokens": len(ids), "output_ids": ids})()
    message = family.parse_completion(text).to_message("c")
    facts = reply_facts(family, result, message)  # type: ignore[arg-type]
    assert facts.reasoning_tokens == expected and facts.ending == "stop"
    facts = reply_facts(family, type(result)(), {**message, "reasoning_content": None})  # type: ignore[arg-type]
    assert facts.reasoning_tokens == 0


def test_namespace_tools_are_flattened_and_hosted_tools_ignored():
    """Codex sends a `namespace` of sub-agent functions and a hosted `web_search` beside its function tools."""
    member = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}
    turn = parse_responses({"input": "x", "tools": [
        {"type": "web_search", "external_web_access": False},
        {"type": "namespace", "name": "multi_agent_v1", "description": "d", "tools": [member]}]}, None)
    assert turn.chat["tools"] == [{"type": "function", "function": {"name": "spawn_agent",
                                                                    "parameters": {"type": "object"}}}]
    assert turn.namespaces == {"spawn_agent": "multi_agent_v1"} and turn.ignored == ["tools.web_search"]
    call = {"id": "call_r_0", "type": "function", "function": {"name": "spawn_agent", "arguments": "{}"}}
    body = response_body("r", "m", 0, turn, {"role": "assistant", "content": "", "tool_calls": [call]},
                         ReplyFacts("tool_calls", None, 1, 0, 1, 0))
    assert body["output"][0]["namespace"] == "multi_agent_v1"
