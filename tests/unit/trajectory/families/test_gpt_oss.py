"""gpt-oss against oracles we did not write: OpenAI's `openai-harmony` encoder and SGLang 0.5.23's harmony parsers.

- Tokenizer: the o200k ranks the builder takes from quicktok-v1 are OpenAI's published `o200k_base.tiktoken` (sha256),
  and our Hugging Face tokenizer encodes like harmony's own encoder (hypothesis texts, special-token spellings too).
- Template: our rendered ids == `openai-harmony`'s render of the same conversation (system and developer messages,
  tools as its TypeScript namespace, multi-turn with reasoning, preambles, calls and tool results, reasoning effort,
  its analysis-dropping rule), with and without the generation prompt. The conversation is mapped to harmony messages
  here, by hand, as the template's header describes.
- TITO: every appended prompt of a tool loop == the stored prompt + completion (`<|return|>` written `<|end|>`) +
  harmony's render of each appended message + `<|start|>assistant`; harmony's own parser reads our completions as we
  do.
- Parsers: our parse == SGLang's `gpt-oss` reasoning parser then its `gpt-oss` tool-call detector (hypothesis replies:
  reasoning, preambles, answers and calls with nested JSON and unicode, cut anywhere).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.sglang_real import import_sglang_schema
from support.tito import _ALPHABET, ARGUMENT_NAME, CALL_NAME
from support.tito import call_item as _call
from trajectory import LinearTrajectory, ModelFamily
from trajectory.families.gpt_oss import CALL

harmony = pytest.importorskip("openai_harmony")
from openai_harmony import (  # noqa: E402
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

SETTINGS = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def family(families: dict[str, ModelFamily]) -> ModelFamily:
    return families["gpt-oss"]


@pytest.fixture(scope="module")
def encoding(tokenizer_dirs: dict[str, Path]) -> Any:
    """harmony's encoder, offline: it reads `o200k_base.tiktoken` from the directory the builder wrote it to."""
    previous = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(tokenizer_dirs["gpt-oss"])
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if previous is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = previous


# -- tokenizer ------------------------------------------------------------------------------------------------------
def test_ranks_are_openais_published_file(tokenizer_dirs):
    ranks = (tokenizer_dirs["gpt-oss"] / "o200k_base.tiktoken").read_bytes()
    assert hashlib.sha256(ranks).hexdigest() == "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


@SETTINGS
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
       | st.lists(st.sampled_from(["<|start|>", "<|end|>", "<|message|>", " to=functions.x", "<|channel|>", "東京",
                                   " don't", "12345", "\n\n", "  ", "é"]), max_size=8).map("".join))
def test_ids_equal_harmonys_encoder(family, encoding, text):
    assert family.encode(text) == encoding.encode(text, allowed_special="all")


# -- template -------------------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Look a key up.\nTwo lines.", "parameters": {
        "type": "object", "properties": {
            "key": {"type": "string", "description": "the key"}, "n": {"type": "integer", "default": 3},
            "exact": {"type": "boolean"}, "opts": {"type": "object"}, "mode": {"type": "string", "enum": ["a", "b"]},
            "xs": {"type": "array", "items": {"type": "number"}}, "any": {"type": "array"},
            "maybe": {"type": ["string", "null"]},
            "nested": {"type": "object", "required": ["x"], "properties": {
                "x": {"type": "string"}, "y": {"type": "integer", "description": "yy"},
                "deep": {"type": "object", "properties": {"z": {"type": "boolean"}}}}},
            "rows": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}}},
        "required": ["key"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "ping", "description": "No arguments."}},
    {"type": "function", "function": {"name": "empty", "parameters": {"type": "object"}}},
]


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief. Ünïcödé ok."},
    {"role": "user", "content": "Look up naïve keys 東京"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "need both",
     "tool_calls": [_call(0, "lookup", {"key": "東京", "n": 2, "opts": {"deep": [1, None]}}),
                    _call(1, "add", {"a": 1.5, "b": -2})]},
    {"role": "tool", "tool_call_id": "c0", "content": "found 3"},
    {"role": "tool", "tool_call_id": "c1", "content": "-0.5"},
    {"role": "assistant", "content": "", "reasoning_content": "one more", "tool_calls": [_call(2, "ping", {})]},
    {"role": "tool", "tool_call_id": "c2", "content": "pong"},
    {"role": "assistant", "content": "Both done.", "reasoning_content": "sum them"},
    {"role": "user", "content": "  and again?  "},
    {"role": "system", "content": "Answer in French."},
    {"role": "assistant", "content": "Encore.", "reasoning_content": "french"},
    {"role": "user", "content": "ok"},
]


def _tool_description(tool: dict[str, Any]) -> Any:
    fn = tool["function"]
    return ToolDescription.new(fn["name"], fn.get("description", ""), fn.get("parameters"))


def _harmony(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, effort: str = "medium") -> Any:
    """The conversation as harmony messages (the mapping the template's header states)."""
    system = SystemContent.new().with_reasoning_effort(
        {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}[effort])
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    rest = messages
    if messages[0]["role"] == "system" or tools:
        developer = DeveloperContent.new()
        if messages[0]["role"] == "system":
            developer, rest = developer.with_instructions(messages[0]["content"]), messages[1:]
        if tools:
            developer = developer.with_function_tools([_tool_description(t) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names = {}
    for m in rest:
        if m["role"] == "system":
            out.append(Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(
                m["content"])))
        elif m["role"] == "user":
            out.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif m["role"] == "tool":
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{names[m['tool_call_id']]}"),
                                                       m["content"]).with_recipient("assistant")
                       .with_channel("commentary"))
        else:
            if m.get("reasoning_content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"])
                           .with_channel("analysis"))
            if m.get("tool_calls"):
                if m["content"]:
                    out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("commentary"))
                for call in m["tool_calls"]:
                    names[call["id"]] = call["function"]["name"]
                    out.append(Message.from_role_and_content(Role.ASSISTANT, call["function"]["arguments"])
                               .with_channel("commentary").with_recipient(f"functions.{call['function']['name']}")
                               .with_content_type("<|constrain|>json"))
            else:
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final"))
    return Conversation.from_messages(out)


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
@pytest.mark.parametrize("effort", [None, "high"])
def test_rendered_ids_equal_harmonys_renderer(family, encoding, tools, effort):
    kwargs = {"reasoning_effort": effort} if effort else None
    for start in (0, 1):  # with and without a system message
        for end in range(start + 2, len(CONVERSATION) + 1):
            messages = CONVERSATION[start:end]
            conversation = _harmony(messages, tools, effort or "medium")
            ours = family.encode(family.render(messages, tools, True, kwargs))
            assert ours == encoding.render_conversation_for_completion(conversation, Role.ASSISTANT), (start, end)
            ours = family.encode(family.render(messages, tools, False, kwargs))
            assert ours == encoding.render_conversation(conversation), (start, end)


def test_a_tool_result_is_named_by_its_call(family):
    """By `tool_call_id`, else by position among the calls before it; a result that answers no call is `unknown`."""
    calls = [_call(0, "lookup", {}), {"type": "function", "function": {"name": "add", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c0", "content": "a"}, {"role": "tool", "content": "b"}]
    text = family.render(messages, None, True)
    assert "<|start|>functions.lookup to=assistant" in text and "<|start|>functions.add to=assistant" in text
    text = family.render([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}], None, True)
    assert "<|start|>functions.unknown to=assistant" in text
    # appended after stored turns: named from the stored calls
    history = [*messages[:2], {"role": "assistant", "content": "", "tool_calls": calls}]
    appended = family.appended_messages([*history, {"role": "tool", "tool_call_id": "c0", "content": "a"},
                                         {"role": "tool", "content": "b"}], len(history))
    assert [m["name"] for m in appended] == ["lookup", "add"]


# -- TITO -----------------------------------------------------------------------------------------------------------
def test_tito_appends_harmonys_messages_after_the_generated_ones(family, encoding):
    from support.tito import Reply, generate

    traj = LinearTrajectory(family)
    history: list[dict[str, Any]] = [CONVERSATION[0], CONVERSATION[1]]
    replies = [Reply("Let me see.", "plan it", (("lookup", '{"key": "a", "n": 1}'),)),
               Reply("", "again", (("add", '{"a": 1, "b": 2}'),)),
               Reply("Done: 3.", "all there"),
               Reply("Encore.", None)]
    appended_after = [
        [{"role": "tool", "tool_call_id": "call_r0_0", "content": "1"}],
        [{"role": "tool", "tool_call_id": "call_r1_0", "content": "3"}, {"role": "user", "content": "sum?"}],
        [{"role": "system", "content": "In French."}, {"role": "user", "content": "encore"}],
    ]
    previous: list[int] | None = None
    for k, reply in enumerate(replies):
        plan = traj.prepare(history, TOOLS)
        if previous is not None:
            names = {"call_r0_0": "lookup", "call_r1_0": "add"}
            expected = list(previous[:-1] if previous[-1] == family.tokenizer.convert_tokens_to_ids("<|return|>")
                            else previous)
            if previous[-1] != family.tokenizer.convert_tokens_to_ids(CALL):
                expected += family.encode("<|end|>")
            for m in appended_after[k - 1]:
                if m["role"] == "tool":
                    message = Message.from_author_and_content(
                        Author.new(Role.TOOL, f"functions.{names[m['tool_call_id']]}"), m["content"]
                    ).with_recipient("assistant").with_channel("commentary")
                elif m["role"] == "system":
                    message = Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(
                        m["content"]))
                else:
                    message = Message.from_role_and_content(Role.USER, m["content"])
                expected += encoding.render(message)
            expected += family.encode("<|start|>assistant")
            assert plan.prompt_ids.tolist() == expected, k
        result, message = generate(family, plan, reply, rid=f"r{k}")
        completion = result.output_ids.tolist()
        # harmony's own parser reads the completion as we do
        parsed = encoding.parse_messages_from_completion_tokens(completion, Role.ASSISTANT)
        assert [m.channel for m in parsed] == (["analysis"] if reply.reasoning is not None else []) + (
            ["commentary"] * (bool(reply.content) + len(reply.tool_calls)) if reply.tool_calls else ["final"])
        assert [m.recipient for m in parsed if m.recipient] == [f"functions.{n}" for n, _ in reply.tool_calls]
        assert "".join(c.text for m in parsed if m.channel == "analysis" for c in m.content) == (reply.reasoning or "")
        traj.commit(plan, result, message)
        previous = plan.prompt_ids.tolist() + completion
        history = [*history, message, *(appended_after[k] if k < len(appended_after) else [])]


# -- SGLang's own parsers -------------------------------------------------------------------------------------------
_gpt_oss_tools = import_sglang_schema("sglang.srt.function_call.gpt_oss_detector")
_reasoning = import_sglang_schema("sglang.srt.parser.reasoning_parser")
_protocol = import_sglang_schema("sglang.srt.entrypoints.openai.protocol")

_WORD = st.text(_ALPHABET, min_size=1, max_size=10)
_LOOKALIKE = st.sampled_from(["to=functions.x", "analysis", "final", "commentary", "{\"a\": 1}", "json", "<>", "</>"])
_PROSE = st.lists(_WORD | _LOOKALIKE | st.sampled_from([" ", "\n", "\n\n"]), min_size=1, max_size=8).map(
    "".join).filter(lambda s: s.strip() == s and s.strip())
_SCALAR = (st.integers(-10**9, 10**9) | st.floats(allow_nan=False, allow_infinity=False) | st.booleans()
           | st.text(_ALPHABET, max_size=12))
_JSON = st.recursive(st.none() | _SCALAR, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_WORD, inner, max_size=3), max_leaves=8)
_ARGS = st.dictionaries(ARGUMENT_NAME, _JSON, max_size=4)
_NAME = CALL_NAME


def _sglang(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, str, list[tuple[str, str]]]:
    """SGLang's chat path for gpt-oss: the `gpt-oss` reasoning parser (forced: harmony always starts a message),
    then the `gpt-oss` tool-call detector on the rest."""
    thought = _reasoning.GptOssDetector(stream_reasoning=False).detect_and_parse(text)
    rest = thought.normal_text or ""
    detector = _gpt_oss_tools.GptOssDetector()
    if detector.has_tool_call(rest):
        parsed = detector.detect_and_parse(rest, [_protocol.Tool(**tool) for tool in tools])
        return thought.reasoning_text, parsed.normal_text, [(c.name, c.parameters) for c in parsed.calls]
    return thought.reasoning_text, rest, []


@SETTINGS
@given(content=st.none() | _PROSE.filter(lambda s: not "commentary".startswith(s.lower())), reasoning=_PROSE,
       call=st.none() | st.tuples(_NAME, _ARGS), cut=st.none() | st.integers(0, 400))
@example(content=None, reasoning="0", call=("a00000000", {}), cut=129)  # cut right after the call's <|message|>
def test_parse_equals_sglangs_gpt_oss_parsers(family, content, reasoning, call, cut):
    """Replies as gpt-oss writes them: its reasoning first, then an answer, or an optional preamble and one call (its
    `<|call|>` stop token in SGLang's text, as SGLang keeps it with the gpt-oss parser; our text has it or not). Cut
    anywhere (length): SGLang holds back a message it has not seen the end of except reasoning and an answer, and so
    do we. Known divergences, outside this domain: SGLang's detector finds calls only after another message (it looks
    for `<|start|>assistant<|channel|>commentary`), a reply that is only a call is a call to us; SGLang's filter for
    "commentary" filler after a call drops a preamble that spells a prefix of that word ("C", "comm")."""
    calls = [(call[0], json.dumps(call[1], ensure_ascii=False))] if call else []
    tools = [{"type": "function", "function": {"name": call[0], "parameters": {"type": "object"}}}] if call else []
    whole = family.format_completion(content or "", reasoning, calls)
    text = whole[:cut]
    sglang_text = text + CALL if calls and text == whole else text
    ours = family.parse_reply(text, True, tools)
    assert family.parse_reply(sglang_text, True, tools) == ours
    thought, sg_content, sg_calls = _sglang(sglang_text, tools)
    assert (ours.reasoning_content or "", ours.content.strip() if calls else ours.content) == (
        thought or "", sg_content.strip() if calls else sg_content)
    assert [(c.name, c.arguments) for c in ours.tool_calls] == sg_calls


def test_reasoning_ends_with_the_last_analysis_message(family):
    """Reasoning tokens: through the `<|end|>` of the last analysis message; all of a reply cut inside one; none
    without one (a preamble or a call on commentary is not reasoning)."""
    end = family.encode("<|end|>")[0]
    for reasoning, content, calls in (("plan it", "Done.", []), ("x", "", [("add", '{"a": 1}')]),
                                      ("a\nb", "Pre.", [("add", "{}")])):
        ids = family.encode(family.format_completion(content, reasoning, calls))
        assert family.reasoning_end(ids) == ids.index(end) + 1
        assert family.reasoning_end(ids[:ids.index(end) - 1]) == ids.index(end) - 1  # cut inside the analysis
    for content, calls in (("Done.", []), ("Pre.", [("add", "{}")])):
        assert family.reasoning_end(family.encode(family.format_completion(content, None, calls))) == 0
    twice = family.format_completion("", "one", []).replace("<|channel|>final", "<|channel|>analysis", 1)
    ids = family.encode(twice + "<|end|>")
    assert family.reasoning_end(ids) == len(ids)
