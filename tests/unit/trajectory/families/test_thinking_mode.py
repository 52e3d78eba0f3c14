"""Thinking mode (`ModelFamily.thinking_mode`) and the `require_reasoning` flag it puts on a constrained /generate.

SGLang 0.5.23's chat server sends `require_reasoning: true` on every request in thinking mode, and an engine with
`--reasoning-parser` then holds the request's grammar back until the reasoning ends. Here, per family: the mode read
from the request's template kwargs agrees with what the family's template renders (a prompt that closes the think
block is not thinking mode, one that opens it is), and the /generate body carries the flag exactly for a constrained
turn in thinking mode (a forced or named call, an auto choice capped at one call, a JSON answer), never for an
unconstrained one. tests/sglang/test_thinking_mode_oracle.py holds the mode to SGLang's own decision.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np
import pytest

from session_server.chat.protocol import parse_chat_request
from session_server.engine.reasoning import ungated_grammar_warning
from session_server.engine.wire import GenerateRequest, encode_generate
from session_server.frontend.chat_request import turn_tools
from support.families import FAMILIES
from support.families import THINKING as EXPECTED
from trajectory import ModelFamily

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
# (tool_choice, parallel_tool_calls, response_format): what the turn asks, and whether it puts a grammar on the engine.
REQUESTS: list[tuple[Any, bool, Any, bool]] = [
    ("required", True, None, True),
    ({"type": "function", "function": {"name": "lookup"}}, True, None, True),
    ("auto", True, None, False),
    ("auto", False, None, True),
    ("none", True, {"type": "json_object"}, True),
    ("none", True, None, False),
]


def test_the_families_are_the_table() -> None:
    assert set(EXPECTED) == set(FAMILIES)


def _kwargs(switch: str | None, value: bool | None) -> dict[str, Any] | None:
    return None if value is None or switch is None else {switch: value}


@pytest.mark.parametrize("name", FAMILIES)
def test_thinking_mode_follows_the_switch_and_agrees_with_the_rendered_prompt(
        families: dict[str, ModelFamily], name: str) -> None:
    family = families[name]
    switch, default, on, off = EXPECTED[name]
    assert family.thinking_switch == switch
    for value, thinks in ((None, default), (True, on), (False, off)):
        kwargs = _kwargs(switch, value)
        assert family.thinking_mode(kwargs) is thinks, (value, kwargs)
        prompt = family.render([{"role": "user", "content": "hi"}], None, True, kwargs)
        if family.reasoning_markers is not None:
            # A generation prompt that closes the reasoning block answers at once: not thinking mode.
            assert prompt.rstrip().endswith(family.reasoning_markers[1]) is not thinks, prompt[-40:]
        if thinks and family.reply_opening:
            assert family.opened_reply(family.encode(prompt)) == family.reply_opening
    if switch is not None:  # SGLang compares with `is`: a value that is not a boolean leaves the default
        assert family.thinking_mode({switch: 0}) is default and family.thinking_mode({switch: "yes"}) is default


@pytest.mark.parametrize("name", FAMILIES)
def test_the_generate_body_asks_to_hold_the_grammar_back_exactly_for_a_constrained_thinking_turn(
        families: dict[str, ModelFamily], name: str) -> None:
    family = families[name]
    switch, default, on, off = EXPECTED[name]
    for value, thinks in ((None, default), (True, on), (False, off)):
        for choice, parallel, response_format, constrained in REQUESTS:
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                    "tool_choice": choice, "parallel_tool_calls": parallel}
            if response_format is not None:
                body["response_format"] = response_format
            if _kwargs(switch, value) is not None:
                body["chat_template_kwargs"] = _kwargs(switch, value)
            chat = parse_chat_request(json.dumps(body).encode(), family.stop_token_ids, family.vocab_size)
            turn_tools(chat, family)
            sent = msgspec.json.decode(encode_generate(GenerateRequest(
                input_ids=np.arange(3, dtype="int32"), sampling_params=chat.sampling_params, rid="r" * 32,
                thinking=family.thinking_mode(chat.options.chat_template_kwargs))))
            case = (value, choice, parallel, response_format)
            assert ("require_reasoning" in sent) is (thinks and constrained), case
            if "require_reasoning" in sent:
                assert sent["require_reasoning"] is True


def test_the_warning_names_an_engine_without_a_reasoning_parser(families: dict[str, ModelFamily]) -> None:
    qwen3, llama = families["qwen3"], families["llama-3.1"]
    warning = ungated_grammar_warning({"reasoning_parser": None}, qwen3)
    assert warning is not None and "--reasoning-parser qwen3" in warning
    assert ungated_grammar_warning({"reasoning_parser": None}, families["deepseek-v4"]) is not None  # it can think
    assert ungated_grammar_warning({"reasoning_parser": "qwen3"}, qwen3) is None
    assert ungated_grammar_warning({"reasoning_parser": None}, llama) is None  # never reasons
    assert ungated_grammar_warning({"max_req_input_len": 100}, qwen3) is None  # a router's info does not say
