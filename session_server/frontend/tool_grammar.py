"""Forced tool calls in the model's own format: the structural tag SGLang 0.5.23 sends its grammar backend.

For `tool_choice` required or a named function SGLang asks the detector of the model's format for a model-native
structural tag (`get_structural_tag_name`: xgrammar's builtin builders `qwen_3_coder`, `deepseek_v4`, `harmony`), and
only a detector without one gets the legacy JSON-arguments tag (fields.py) or the JSON-array schema. This module builds
those three natively, as `FunctionCallParser.get_structure_constraint(..., thinking_mode=False)` does with a reasoning
parser configured (the model's reasoning is the reasoning parser's, not the grammar's: no reasoning prefix, and the
think tokens stripped from the tag's `excludes`), serialized as SGLang serializes it (`model_dump(by_alias=True)`, so
every field, defaults included). tests/sglang/test_tool_grammar_oracle.py holds each one to SGLang's own output.

Why not import xgrammar: it needs torch and a compiled extension; the server needs a few dozen lines of JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Tag = dict[str, Any]


def _arguments(tool: dict[str, Any]) -> Any:
    """xgrammar's `_get_function_parameters`: the schema, or `true` (any JSON) for a non-strict or schemaless tool."""
    function = tool["function"]
    if function.get("strict") is False or function.get("parameters") is None:
        return True
    return function["parameters"]


def _tag(begin: str, tool: dict[str, Any], style: str, end: str) -> Tag:
    return {"type": "tag", "begin": begin, "content": {
        "type": "json_schema", "json_schema": _arguments(tool), "style": style, "any_order": False,
        "max_whitespace_cnt": None}, "end": end}


def _qwen_3_coder(tools: list[dict[str, Any]], forced: bool, required: bool, parallel: bool) -> Tag:
    tags = [_tag(f"<tool_call>\n<function={t['function']['name']}>\n", t, "qwen_xml", "\n</function>\n</tool_call>")
            for t in tools]
    if forced:
        return tags[0]
    return {"type": "triggered_tags", "triggers": ["<tool_call>\n<function="], "tags": tags, "at_least_one": required,
            "stop_after_first": not parallel, "excludes": []}


_DSML_CALLS_BEGIN, _DSML_CALLS_END = "\n\n<｜DSML｜tool_calls>\n", "</｜DSML｜tool_calls>"


def _deepseek_v4(tools: list[dict[str, Any]], forced: bool, required: bool, parallel: bool) -> Tag:
    tags = [_tag(f'<｜DSML｜invoke name="{t["function"]["name"]}">\n', t, "deepseek_xml", "</｜DSML｜invoke>\n")
            for t in tools]
    calls = tags[0] if forced else {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
                                    "stop_after_first": not parallel}
    body = [{"type": "const_string", "value": _DSML_CALLS_BEGIN}, calls,
            {"type": "const_string", "value": _DSML_CALLS_END}]
    if required:
        return {"type": "sequence", "elements": body}
    # auto (only sent to cap the calls at one): the call block is triggered, any text before it
    return {"type": "triggered_tags", "triggers": ["<｜DSML｜tool_calls>"], "tags": [{
        "type": "tag", "begin": "<｜DSML｜tool_calls>\n", "content": calls, "end": _DSML_CALLS_END}],
        "at_least_one": False, "stop_after_first": True, "excludes": []}


_HARMONY_SEPARATOR = "<|start|>assistant"


def _harmony(tools: list[dict[str, Any]], forced: bool, required: bool, parallel: bool) -> Tag:
    tags = []
    for tool in tools:
        name = tool["function"]["name"]
        tags += [_tag(begin, tool, "json", "<|call|>") for begin in (
            f"<|channel|>commentary to=functions.{name}<|constrain|>json<|message|>",
            f" to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>",
            f" to=functions.{name}<|channel|>commentary json<|message|>")]
    if not required:  # auto: a final answer is a message of its own
        answer: Tag = {"type": "any_text", "excludes": [], "max_tokens": None, "max_chars": None}
        tags.append({"type": "tag", "begin": "<|channel|>final<|message|>", "content": answer,
                     "end": ["<|end|>", "<|return|>"]})
    # One deliberate difference: xgrammar 0.2.7's harmony tag for a forced choice admits no call at all (at_least_one
    # false; with parallel calls off, the one call wrapped in `optional`), so under SGLang's own tag `required` is not
    # enforced on gpt-oss. Here a forced choice forces a call, as it does for every other family.
    if parallel:
        return {"type": "tags_with_separator", "tags": tags, "separator": _HARMONY_SEPARATOR, "at_least_one": required,
                "stop_after_first": False}
    calls = [t for t in tags if t["end"] == "<|call|>"]
    one_call = {"type": "tags_with_separator", "tags": calls, "separator": _HARMONY_SEPARATOR, "at_least_one": True,
                "stop_after_first": True}
    messages = [t for t in tags if t["end"] != "<|call|>"]
    if not messages:
        return one_call
    return {"type": "or", "elements": [
        {"type": "tags_with_separator", "tags": messages, "separator": _HARMONY_SEPARATOR, "at_least_one": False,
         "stop_after_first": False},
        one_call,
        {"type": "sequence", "elements": [
            {"type": "tags_with_separator", "tags": messages, "separator": _HARMONY_SEPARATOR, "at_least_one": True,
             "stop_after_first": False},
            {"type": "const_string", "value": _HARMONY_SEPARATOR}, one_call]}]}


BUILDERS: dict[str, Callable[[list[dict[str, Any]], bool, bool, bool], Tag]] = {
    "qwen_3_coder": _qwen_3_coder, "deepseek_v4": _deepseek_v4, "harmony": _harmony}


def native_structural_tag(model: str, tools: list[dict[str, Any]], named: str | None, required: bool,
                          parallel: bool) -> dict[str, Any]:
    """The structural tag of xgrammar's builtin `model` format: one named tool (`named`), at least one call of any
    tool (`required`), or, for auto, any number of calls or at most one (`parallel` False)."""
    chosen = [t for t in tools if t["function"]["name"] == named] if named is not None else tools
    return {"type": "structural_tag",
            "format": BUILDERS[model](chosen, named is not None, required or named is not None, parallel)}
