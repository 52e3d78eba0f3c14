"""Model families: templates, stop-token rules, completion parsers (examples + the inverse property)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import FAMILIES, NO_REASONING, REWRITES_REPLIES
from support.tito import ARGUMENTS, TEXT, TOOL_NAME
from trajectory import ParsedCompletion, ToolCall, family_names, get_family, register_family
from trajectory.errors import RequestValidationError, TemplateError
from trajectory.families import registry
from trajectory.families.base import _ANCHOR as ANCHOR
from trajectory.families.base import tools_cache_key
from trajectory.families.qwen3 import Qwen3Family
from trajectory.families.xml_tool_calls import _json_type


def test_registry(hf_tokenizers, monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # keep the global registry clean
    assert {"qwen3", "deepseek"} <= set(family_names())
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        get_family("nope", hf_tokenizers["qwen3"])

    @register_family
    class ChatMLNoThink(Qwen3Family):
        name = "test-chatml"

    assert "test-chatml" in family_names()
    assert get_family("test-chatml", hf_tokenizers["qwen3"]).name == "test-chatml"


def test_token_rules(families):
    qwen, deepseek = families["qwen3"], families["deepseek"]
    assert qwen.decode([qwen.eos_token_id]) == "<|im_end|>"
    assert [qwen.decode([t]) for t in qwen.stop_token_ids] == ["<|im_end|>", "<|endoftext|>"]
    assert (qwen.max_trim_tokens, qwen.message_trailer) == (1, "\n")
    assert deepseek.stop_token_ids == (deepseek.eos_token_id,)
    assert deepseek.decode([deepseek.eos_token_id]) == "<｜end▁of▁sentence｜>"
    assert (deepseek.max_trim_tokens, deepseek.message_trailer) == (0, "")
    assert qwen.vocab_size == len(qwen.tokenizer) and deepseek.vocab_size == len(deepseek.tokenizer)


@pytest.mark.parametrize("name", FAMILIES)
def test_fast_encode_matches_the_tokenizer(families, name):
    family = families[name]
    text = family.render([{"role": "user", "content": "héllo  wörld\n\n東京"}], None, add_generation_prompt=True)
    assert family.encode(text) == family.tokenizer.encode(text, add_special_tokens=False)
    assert family.decode(family.encode(text)) == text


def test_appended_text_qwen3(families):
    qwen = families["qwen3"]
    appended = [{"role": "tool", "content": "4"}, {"role": "system", "content": "be brief"},
                {"role": "user", "content": "and 3+3?"}]
    expected = ("<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert qwen.appended_text(appended, None, closed=True) == "\n" + expected
    assert qwen.appended_text(appended, None, closed=False) == "<|im_end|>\n" + expected


def test_appended_text_deepseek(families):
    deepseek = families["deepseek"]
    appended = [{"role": "tool", "content": "4"}, {"role": "tool", "content": "5"}, {"role": "user", "content": "ok"}]
    expected = ("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>4<｜tool▁output▁end｜><｜tool▁output▁begin｜>5"
                "<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜User｜>ok<｜Assistant｜>")
    assert deepseek.appended_text(appended, None, closed=True) == expected
    assert deepseek.appended_text(appended, None, closed=False) == "<｜end▁of▁sentence｜>" + expected


@pytest.mark.parametrize(("name", "role"), [("deepseek", "system")])
def test_appending_a_role_the_family_cannot_append_is_a_400(families, name, role):
    with pytest.raises(RequestValidationError, match=f"family {name} cannot append a '{role}' message") as info:
        families[name].appended_text([{"role": role, "content": "x"}], None, closed=True)
    assert info.value.status == 400


def test_appending_nothing_is_a_400(families):
    with pytest.raises(RequestValidationError, match="adds no message"):
        families["qwen3"].appended_text([], None, closed=True)


def test_template_that_rewrites_history_is_refused(hf_tokenizers):
    """A template whose rendering of earlier messages depends on what follows cannot be done incrementally."""
    tokenizer = copy.copy(hf_tokenizers["qwen3"])  # its own template only (as test_first_turns does)
    tokenizer.chat_template = (
        "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    family = get_family("qwen3", tokenizer)
    with pytest.raises(TemplateError, match=r"family qwen3 .* differs at character 0") as info:
        family.appended_text([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}], None, True)
    assert info.value.status == 400


def test_unrenderable_request_is_a_template_error(families):
    with pytest.raises(TemplateError, match="family deepseek cannot render"):
        families["deepseek"].render([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
                                    None, add_generation_prompt=True)


def test_anchor_prefix_is_cached_per_tools(families):
    qwen = families["qwen3"]
    tools = [{"type": "function", "function": {"name": "calc"}}]
    first = qwen.anchor_prefix(tools)
    assert qwen.anchor_prefix(copy.deepcopy(tools)) is first
    assert qwen.anchor_prefix(None) != first and "calc" in first


@pytest.mark.parametrize("name", FAMILIES)
def test_anchor_cache_tells_key_orders_apart(families, name):
    """Two clients whose schemas differ only in key order render different text: each gets its own prefix."""
    family = families[name]
    params = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    a = [{"type": "function", "function": {"name": "calc", "description": "d", "parameters": params}}]
    b = [{"function": {"parameters": dict(reversed(params.items())), "description": "d", "name": "calc"},
          "type": "function"}]
    assert a == b  # equal as Python values, which is what made a sorted-keys cache key collide
    appended = [{"role": "user", "content": "hi"}]
    prefix_a = family.anchor_prefix(a)
    prefix_b = family.anchor_prefix(b)
    # different whenever the template writes them differently before the anchor's end (harmony's TypeScript rendering
    # reads keys by name; Mistral writes the tools after the anchor, before the last user message)
    full_a, full_b = (family.render([*ANCHOR, *appended], tools, add_generation_prompt=True) for tools in (a, b))
    assert (prefix_a != prefix_b) == (full_a[:len(prefix_a)] != full_b[:len(prefix_b)])
    for full, tools, prefix in ((full_a, a, prefix_a), (full_b, b, prefix_b)):
        assert full.startswith(prefix)
        assert family.appended_text(appended, tools, closed=True).endswith(full[len(prefix):])
    assert tools_cache_key(a) != tools_cache_key(b) and tools_cache_key(None) == tools_cache_key([]) == ""


# -- parsers: examples ------------------------------------------------------------------------------------
def test_qwen3_parses_reasoning_and_parallel_tool_calls(families):
    text = ('<think>\nplan: call both\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Zürich", "days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
            '"arguments": {}}\n</tool_call>')
    assert families["qwen3"].parse_completion(text) == ParsedCompletion(
        content="Let me check.", reasoning_content="plan: call both",
        tool_calls=[ToolCall("get_weather", '{"city": "Zürich", "days": [1, 2]}'), ToolCall("get_time", "{}")],
    )


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": 1}',          # bad JSON
    '{"arguments": {"a": 1}}',                      # missing name
    '{"name": "", "arguments": {}}',                # empty name
    '{"name": "f", "arguments": "{\\"a\\": 1}"}',   # arguments not an object
    '["f", {}]',                                    # not an object
])
def test_qwen3_malformed_tool_call_stays_in_content(families, body):
    good = '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>'
    text = f"Calling.\n<tool_call>\n{body}\n</tool_call>\n{good}"
    parsed = families["qwen3"].parse_completion(text)
    assert parsed.tool_calls == [ToolCall("ok", "{}")]
    assert parsed.content == f"Calling.\n<tool_call>\n{body}\n</tool_call>"


def test_qwen3_unterminated_blocks(families):
    qwen = families["qwen3"]
    assert qwen.parse_completion("<think>\nstill thinking") == ParsedCompletion("", "still thinking", [])
    cut = 'Sure.\n<tool_call>\n{"name": "f", "argu'
    assert qwen.parse_completion(cut) == ParsedCompletion(cut, None, [])
    assert qwen.parse_completion("<think>\n\n</think>\n\nHi") == ParsedCompletion("Hi", "", [])


def test_deepseek_parses_reasoning_and_tool_calls(families):
    text = ("<think>need data</think>Looking it up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            "search\n```json\n{\"q\": \"東京\", \"n\": {\"k\": [true, null]}}\n```<｜tool▁call▁end｜>"
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>noop\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert families["deepseek"].parse_completion(text) == ParsedCompletion(
        content="Looking it up.", reasoning_content="need data",
        tool_calls=[ToolCall("search", '{"q": "東京", "n": {"k": [true, null]}}'), ToolCall("noop", "{}")],
    )


def test_deepseek_malformed_tool_call_stays_in_content(families):
    bad = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>broken\n```json\n{oops\n```<｜tool▁call▁end｜>"
    good = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>fine\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>"
    parsed = families["deepseek"].parse_completion(f"Hi<｜tool▁calls▁begin｜>{bad}{good}<｜tool▁calls▁end｜>")
    assert parsed == ParsedCompletion(content="Hi" + bad, tool_calls=[ToolCall("fine", '{"a": 1}')])
    only_bad = f"Hi<｜tool▁calls▁begin｜>{bad}<｜tool▁calls▁end｜>"
    assert families["deepseek"].parse_completion(only_bad) == ParsedCompletion(only_bad)
    unterminated = f"Hi<｜tool▁calls▁begin｜>{good}"
    assert families["deepseek"].parse_completion(unterminated) == ParsedCompletion(unterminated)


def test_reply_message_assigns_deterministic_call_ids():
    parsed = ParsedCompletion("c", "r", [ToolCall("f", "{}"), ToolCall("g", '{"x": 1}')])
    message = parsed.to_message("call_rid7")
    assert message == {
        "role": "assistant", "content": "c", "reasoning_content": "r",
        "tool_calls": [{"id": "call_rid7_0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                       {"id": "call_rid7_1", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}],
    }
    assert "tool_calls" not in ParsedCompletion("c").to_message("x")


@pytest.mark.parametrize("name", [f for f in FAMILIES if f not in REWRITES_REPLIES])
def test_formatted_completion_is_what_the_template_renders(families, name):
    """format_completion mirrors the template, so a generated turn re-renders to the same text."""
    family = families[name]
    calls = [("f", json.dumps({"a": [1, "ü"]}, ensure_ascii=False)), ("g", "{}")]
    for content in ("", "Done."):
        message = family.parse_completion(family.format_completion(content, None, calls)).to_message("c")
        rendered = family.render([{"role": "user", "content": "q"}, message, {"role": "user", "content": "q2"}],
                                 None, add_generation_prompt=False)
        # after the header (and the template's own markup there: DeepSeek V4's chat-mode `</think>`)
        header = rendered.index(family.assistant_header)
        assert family.format_completion(content, None, calls) + family.eos_token in rendered[header:]


@pytest.mark.parametrize("name", FAMILIES)
def test_parse_output_reads_the_generated_ids(families, name):
    family = families[name]
    text = family.format_completion("Hi there", "why not", [("f", '{"k": "v"}')])
    for stop in (*family.stop_token_ids, None):
        ids = family.encode(text) + ([stop] if stop is not None else [])
        assert family.completion_text(ids) == text
        assert family.parse_output(ids) == family.parse_completion(text)


# -- parsers: the inverse property ------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=examples(150), deadline=None)
@given(content=TEXT | st.just("") | st.just("\n x \n"), reasoning=st.none() | TEXT | st.just("") | st.just("\na\n"),
       calls=st.lists(st.tuples(TOOL_NAME, ARGUMENTS), max_size=3))
@example(content="", reasoning=None, calls=[("a", '{"0": "NULL", "1": "null x"}')])
def test_parse_inverts_format(families, name, content, reasoning, calls):
    """With the tools typed as the arguments are (XML-call families write values as bare text: the schema types
    them), and one tool per call. A bare value that reads `null` in any case is null whatever the schema says, as
    SGLang's Qwen3CoderDetector reads it (`_convert_param_value` checks it first): that format cannot carry the
    string "null"."""
    family = families[name]
    reasoning = None if name in NO_REASONING else reasoning
    calls = [(f"{n}_{i}", a) for i, (n, a) in enumerate(calls)]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        k: {"type": _json_type(v)} for k, v in json.loads(a).items()}}}} for n, a in calls]
    parsed = family.parse_completion(family.format_completion(content, reasoning, calls), tools)
    if name == "deepseek-v4":  # DSML string values are stripped when parsed, as SGLang's deepseekv4 detector does
        calls = [(n, json.dumps({k: v.strip() if isinstance(v, str) else v for k, v in json.loads(a).items()},
                                ensure_ascii=False)) for n, a in calls]
    if family.structural_tag_format == "qwen_3_coder":
        calls = [(n, json.dumps({k: None if isinstance(v, str) and v.lower() == "null" else v
                                 for k, v in json.loads(a).items()}, ensure_ascii=False)) for n, a in calls]
    assert parsed == ParsedCompletion(content, reasoning, [ToolCall(n, a) for n, a in calls])
