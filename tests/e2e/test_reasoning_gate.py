"""A thinking model thinks before a forced tool call or a JSON answer, as behind SGLang's own chat server.

SGLang 0.5.23's chat server sends `require_reasoning: true` for a turn in thinking mode, and an engine run with
`--reasoning-parser` then holds the request's grammar back until the reasoning ends; without the flag (or without
the parser) the grammar applies from the first token. Here, for every family through the session server and a
recording proxy: the /generate body carries the flag exactly for a constrained turn in thinking mode (the family's
default, its switch on and off), and the scripted reasoning comes before the forced call behind a sim with a reasoning
parser. Behind a sim without one the server warns at startup, and the grammar starts at once. The sim's side of the
wire (a wrong type, no grammar) is checked directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.launchers import RunningProcess, start_sim
from support.families import FAMILIES, SGLANG_PARSERS, THINKING
from support.server import TOOLS, assert_engine_baseline, chat_url, new_session
from support.sim import chat_ids
from support.stack import Stack, StackFactory

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}
ASK = [{"role": "user", "content": "Look it up, after some thought. [[sim: think]]"}]
WARNING = "runs without --reasoning-parser"


def _sim_args(family: str) -> tuple[str, ...]:
    parser = SGLANG_PARSERS[family][1]
    return ("--reasoning-parser", parser) if parser else ()


@pytest.fixture(scope="module", params=FAMILIES)
def stack(request: pytest.FixtureRequest, stack_factory: StackFactory) -> Iterator[Stack]:
    family = request.param
    with stack_factory(family=family, sim_args=_sim_args(family), proxied={"server"}) as stack:
        yield stack


def _chat(stack: Stack, **fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """One turn of a new session: the reply's message and the /generate body the engine received."""
    assert stack.proxy is not None
    stack.proxy.clear()
    sid = new_session(stack.server)
    r = httpx.post(chat_url(stack.server, sid), json={"messages": ASK, "tools": [*TOOLS, LOOKUP], **fields},
                   timeout=60)
    assert r.status_code == 200, r.text
    (sent,) = stack.proxy.generates()
    assert httpx.delete(f"{stack.server}/sessions/{sid}", timeout=30).status_code == 204
    return r.json()["choices"][0]["message"], sent["request"]


def test_a_forced_call_in_thinking_mode_lets_the_model_think_first(stack: Stack) -> None:
    switch, default, on, off = THINKING[stack.family]
    modes = [(None, default)] + ([(True, on), (False, off)] if switch is not None else [])
    for value, thinks in modes:
        kwargs = {} if value is None else {"chat_template_kwargs": {switch: value}}
        for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
            message, sent = _chat(stack, tool_choice=choice, **kwargs)
            label = (value, choice, message)
            assert sent.get("require_reasoning") is (True if thinks else None), label
            assert message["tool_calls"], label
            # Behind an engine with a reasoning parser, the scripted reasoning comes before the forced call.
            assert bool(message.get("reasoning_content")) is thinks, label
        # No grammar (auto, parallel calls allowed): nothing to hold back, no flag; the model thinks as it likes.
        message, sent = _chat(stack, **kwargs)
        assert "require_reasoning" not in sent and "structural_tag" not in sent["sampling_params"], value
        assert bool(message.get("reasoning_content")) is thinks, (value, message)
    assert_engine_baseline(stack.engine)


def _output(proc: RunningProcess, needle: str, timeout: float = 60.0) -> str:
    """Wait until the process has printed a line with `needle` (it prints it once the engine has answered)."""
    deadline = time.monotonic() + timeout
    while not (lines := [line for line in proc.output if needle in line]):
        assert time.monotonic() < deadline, f"no {needle!r} in the output:\n{proc.tail()}"
        time.sleep(0.05)
    return lines[0]


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_the_server_warns_of_an_engine_without_a_reasoning_parser(stack_factory: StackFactory,
                                                                  parser: str | None) -> None:
    """One warning at startup, from the engine's /server_info; the turn still goes to the engine with the flag (as
    SGLang's own server sends it), and such an engine constrains the forced call from its first token."""
    sim_args = ("--reasoning-parser", parser) if parser else ()
    with stack_factory(family="qwen3", sim_args=sim_args, servers={"server": ("--log-level", "info")},
                       proxied={"server"}) as stack:
        server = stack.procs[1]
        _output(server, "engine accepts prompts of up to")  # logged after the same /server_info answer
        warnings = [line for line in server.output if WARNING in line]
        assert len(warnings) == (0 if parser else 1), server.tail()
        message, sent = _chat(stack, tool_choice="required")
        assert sent["require_reasoning"] is True and message["tool_calls"]
        assert bool(message.get("reasoning_content")) is (parser is not None), message


@pytest.fixture(scope="module")
def sims(tokenizer_dirs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        dict[str | None, str]]:
    logs = tmp_path_factory.mktemp("sims")
    with start_sim(tokenizer_dirs["qwen3"], "qwen3", log_dir=logs / "plain") as plain, \
            start_sim(tokenizer_dirs["qwen3"], "qwen3", "--reasoning-parser", "qwen3", log_dir=logs / "gated") as gated:
        yield {None: plain.url, "qwen3": gated.url}


def test_the_sim_holds_a_grammar_back_only_when_asked_and_able(sims: dict[str | None, str],
                                                               hf_tokenizers: dict[str, Any]) -> None:
    ids = chat_ids(hf_tokenizers["qwen3"], ASK)
    schema = json.dumps({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]})
    for parser, url in sims.items():
        assert httpx.get(f"{url}/server_info", timeout=10).json()["reasoning_parser"] == parser
        assert httpx.get(f"{url}/model_info", timeout=10).json()["reasoning_parser"] == parser
        for flag in (None, False, True):
            extra = {} if flag is None else {"require_reasoning": flag}
            r = httpx.post(f"{url}/generate", timeout=30, json={
                "input_ids": ids, "sampling_params": {"json_schema": schema, "skip_special_tokens": False}, **extra})
            assert r.status_code == 200, r.text
            text = r.json()["text"]
            gated = bool(flag) and parser is not None
            assert text.startswith("<think>") is gated, (parser, flag, text)
            assert json.loads(text.split("</think>")[-1])["key"], text  # the JSON answer, after any reasoning
            # Without a grammar the flag changes nothing: the scripted reasoning comes first either way.
            plain = httpx.post(f"{url}/generate", timeout=30, json={"input_ids": ids, **extra}).json()["text"]
            assert plain.startswith("<think>"), plain
        # SGLang's two refusals (tests/sglang/test_sim_differential.py holds them to its texts): FastAPI's parse
        # refuses what pydantic cannot read as a boolean, the contract gate any other value that is not one.
        for wrong in ("yes", 1, 0.0):
            r = httpx.post(f"{url}/generate", timeout=30, json={"input_ids": ids, "require_reasoning": wrong})
            assert r.status_code == 400, r.text
            assert r.json() == {"error": f"invalid type: {_unexpected(wrong)}, expected a boolean"}, r.text
        for wrong in (None, "maybe", 2, [True], {"x": 1}):
            r = httpx.post(f"{url}/generate", timeout=30, json={"input_ids": ids, "require_reasoning": wrong})
            assert r.status_code == 400 and r.json()["object"] == "error", r.text
            assert "'loc': ('body', 'require_reasoning')" in r.json()["message"], r.text


def _unexpected(value: Any) -> str:
    return {str: f'string "{value}"', int: f"integer `{value}`", float: f"floating point `{value}`"}[type(value)]


def test_every_front_end_and_a_stream_ask_the_same(stack_factory: StackFactory) -> None:
    """The Responses and Anthropic front ends set the thinking switch from `reasoning.effort` / `thinking`, and a
    streamed chat goes to the engine as a plain one: each forced call says `require_reasoning` exactly in thinking
    mode (the turn pipeline decides it for every API, turns/turn.py)."""
    lookup = LOOKUP["function"]
    responses_tool = {"type": "function", "name": "lookup", "parameters": lookup["parameters"]}
    anthropic_tool = {"name": "lookup", "input_schema": lookup["parameters"]}
    text = ASK[0]["content"]
    with stack_factory(family="qwen3", sim_args=("--reasoning-parser", "qwen3"), proxied={"server"}) as stack:
        assert stack.proxy is not None
        bodies = {
            ("responses", True): {"model": "m", "input": text, "tools": [responses_tool], "tool_choice": "required"},
            ("responses", False): {"model": "m", "input": text, "tools": [responses_tool], "tool_choice": "required",
                                   "reasoning": {"effort": "none"}},
            ("messages", True): {"model": "m", "max_tokens": 200, "messages": ASK, "tools": [anthropic_tool],
                                 "tool_choice": {"type": "any"}},
            ("messages", False): {"model": "m", "max_tokens": 200, "messages": ASK, "tools": [anthropic_tool],
                                  "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}},
            ("chat/completions", True): {"messages": ASK, "tools": [LOOKUP], "tool_choice": "required",
                                         "stream": True},
            ("chat/completions", False): {"messages": ASK, "tools": [LOOKUP], "tool_choice": "required",
                                          "stream": True, "chat_template_kwargs": {"enable_thinking": False}},
        }
        for (api, thinks), body in bodies.items():
            stack.proxy.clear()
            sid = new_session(stack.server)
            r = httpx.post(f"{stack.server}/sessions/{sid}/v1/{api}", json=body, timeout=60)
            assert r.status_code == 200, (api, r.text)
            (sent,) = stack.proxy.generates()
            assert sent["request"].get("require_reasoning") is (True if thinks else None), (api, thinks)
            assert "structural_tag" in sent["request"]["sampling_params"], api
            # The reasoning the engine let through first reaches each API's reply as its own reasoning item.
            assert _reasoned(api, r) is thinks, (api, r.text[:400])
            assert httpx.delete(f"{stack.server}/sessions/{sid}", timeout=30).status_code == 204
        assert_engine_baseline(stack.engine)


def _reasoned(api: str, r: httpx.Response) -> bool:
    """Whether the reply carries reasoning: a Responses `reasoning` item, an Anthropic `thinking` block, a streamed
    chat's `reasoning_content` delta."""
    if api == "responses":
        return any(item["type"] == "reasoning" for item in r.json()["output"])
    if api == "messages":
        return any(block["type"] == "thinking" for block in r.json()["content"])
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return any(choice["delta"].get("reasoning_content") for chunk in chunks for choice in chunk["choices"])
