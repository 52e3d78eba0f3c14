"""XML tool calls: `<tool_call>`, `<function=NAME>` and `<parameter=ARG>` elements around bare-text values.

Qwen3.5/3.6 (and Qwen3-Coder) write arguments as one XML element per top-level key with the value as bare text, so a
value's JSON type is not in the text: `42` may be a string or an integer. The tool's JSON schema decides, exactly as
SGLang 0.5.23's `Qwen3CoderDetector` decides (string types stay text, integer/number/boolean types are converted,
objects and arrays are JSON, `null` is null whatever the type, a parameter the schema does not know stays text).
Parsing follows that detector's rules too (tests/unit/trajectory/families/test_oracles.py holds us to them):
the content is the text
before the first `<tool_call>`, a `<tool_call>` block without a `<function=` inside yields no call, and a reply cut off
inside a call still yields the call as far as it was written when no block was closed. Where SGLang would produce
invalid JSON (a NaN) or drop every call on an exception (a Python literal that JSON cannot hold), the value stays
text instead.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import ToolCall

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_TEXT_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def _json_type(value: Any) -> str | None:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return None


def schema_type(schema: Any) -> str | None:
    """The primary type of a parameter schema: `type` (first non-null of a list), anyOf/oneOf (one type, an optional
    one, else string first), enum (the values' one type, else string), allOf (first non-string), properties, items."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind
    if isinstance(kind, list) and kind:
        return next((t for t in kind if t != "null"), "string")
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        types = [t for t in map(schema_type, branches) if t]
        if types:
            distinct = set(types)
            if len(distinct) == 1:
                return types[0]
            if len(distinct) == 2 and "null" in distinct:
                return next(t for t in types if t != "null")
            return "string" if "string" in distinct else types[0]
    if isinstance(schema.get("enum"), list):
        kinds = {_json_type(v) for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        return next((t for t in map(schema_type, schema["allOf"]) if t and t != "string"), "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def schema_properties(schema: Any) -> dict[str, Any]:
    """Top-level `properties` of a parameters schema, looking into anyOf/oneOf/allOf branches when it has none."""
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, dict):
        return properties
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            for branch in branches:
                for key, value in schema_properties(branch).items():
                    merged.setdefault(key, value)
    return merged


def parameter_schemas(name: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """The parameter schemas of tool `name` ({} when the tool or its parameters are unknown)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if tool.get("type") == "function" and isinstance(function, Mapping) and function.get("name") == name:
            params = function.get("parameters")
            if not isinstance(params, dict):
                return {}
            properties = schema_properties(params)
            return properties if properties or "properties" in params else params
    return {}


def _literal(text: str) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return text
    return value


def convert_value(text: str, schema: Any, known: bool) -> Any:
    """One parameter's text as the JSON value its schema says it is."""
    if text.lower() == "null":
        return None
    if not known:
        return text
    kind = (schema_type(schema) or "string").strip().lower()
    if kind in _TEXT_TYPES:
        return text
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        exact = "." not in text and "e" not in text.lower()
        return int(number) if exact and number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            pass
    return _literal(text)


def parse_calls(text: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """(content before the first call, the calls) of a generated text; (text, []) when it opens no call."""
    if CALL_OPEN not in text:
        return text, []
    blocks = _BLOCK.findall(text)
    if not blocks and "<function=" in text:
        blocks = [text]  # cut off inside its only call: parsed as far as it goes
    calls: list[ToolCall] = []
    for block in blocks:
        for closed, open_ended in _FUNCTION.findall(block):
            body = closed or open_ended
            if ">" not in body:
                continue
            name, params_text = body.split(">", 1)
            schemas = parameter_schemas(name, tools)
            arguments: dict[str, Any] = {}
            for param in _PARAMETER.findall(params_text):
                if ">" not in param:
                    continue
                key, value = param.split(">", 1)
                value = value.removeprefix("\n").removesuffix("\n")
                arguments[key] = convert_value(value, schemas.get(key), key in schemas)
            calls.append(ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
    return text[: text.find(CALL_OPEN)], calls


def format_value(value: Any, json_scalars: bool) -> str:
    """A value as the template writes it: strings bare, objects and arrays as JSON, other scalars as JSON
    (`json_scalars`, Qwen3.6) or as Python's `str` (Qwen3.5: `True`, `None`)."""
    if isinstance(value, str):
        return value
    if json_scalars or isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def format_call(name: str, arguments: Mapping[str, Any], json_scalars: bool) -> str:
    params = "".join(f"<parameter={key}>\n{format_value(value, json_scalars)}\n</parameter>\n"
                     for key, value in arguments.items())
    return f"{CALL_OPEN}\n<function={name}>\n{params}</function>\n{CALL_CLOSE}"
