"""The OpenAI request fields beyond messages/tools/stream, honoured the way SGLang 0.5.23's OpenAI server honours them.

Why a module of its own: each field maps to something different -- sampling keys (penalties, `min_p`, `logit_bias`),
constrained decoding (`response_format`, `tool_choice`), what the prompt renders (`tool_choice: none` drops the tools,
a named function keeps only that tool, `chat_template_kwargs` reaches the template), what the reply carries
(`logprobs`, `stream_options`). The reference is `serving_chat.py` / `protocol.py` of the released SGLang:

- `response_format` json_schema -> `json_schema` sampling key (the schema as JSON text); json_object ->
  `json_schema = '{"type": "object"}'`; `text` -> nothing.
- `tool_choice` required / a named function -> a structural tag in the model's own tool-call format: the model-native
  tag where SGLang's detector has one (XML Qwen3.5/3.6, DSML DeepSeek V4, harmony: tool_grammar.py), else SGLang's
  "legacy" JSON-arguments tag of `get_legacy_structural_tag(at_least_one=True)` (Qwen3 `<tool_call>`, DeepSeek V3,
  Llama 3.1 `<|python_tag|>`, Mistral `[TOOL_CALLS]`), or, for a family without either, `get_json_schema_constraint`'s
  array schema. Combined with a response_format
  constraint it is a 400, as in `to_sampling_params`.
- `tool_choice: none` -> the tools are not rendered into the prompt and tool calls are not parsed.
- `parallel_tool_calls: false` -> the tool-call constraint allows exactly one call (xgrammar's triggered tags with
  `stop_after_first`, the shape SGLang builds where it limits the count; `maxItems: 1` in the json_schema fallback).
- `logprobs` / `top_logprobs` -> `top_logprobs_num` on /generate, and `choices[0].logprobs` in OpenAI's shape.

Anything the server cannot honour is a 400 that names the field; no accepted field is silently dropped. Every number
is bounded before it can reach the engine (an int beyond 64 bits never gets past here).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgspec

from session_server.frontend import token_ids
from session_server.frontend.tool_grammar import native_structural_tag
from session_server.http.body import check_json_value
from trajectory.errors import RequestValidationError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_INT32 = 2**31 - 1
SCHEMA_VERDICTS = 1024  # distinct tool/response schemas whose validity is remembered...
CACHED_SCHEMA_BYTES = 16 * 1024  # ...if their sorted JSON is at most this long (real tool schemas: 0.2-2 KB)
# OpenAI's own limit on tools per request; each new schema costs a metaschema check (1-2 ms) before anything is cached.
MAX_TOOLS = 128
TOOL_LIST_VERDICTS = 256  # distinct tools lists whose verdict is remembered...
CACHED_TOOL_LIST_BYTES = 64 * 1024  # ...if their JSON is at most this long (8 real tools: 2-10 KB)
# Keys the template call itself owns; a request may not override them through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "messages", "conversation", "tools", "documents", "tokenize", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# Fields SGLang's chat server does not honour for a token-in-token-out session either: refused, not dropped.
_UNSUPPORTED = {
    "functions": "the legacy 'functions' field is not supported; send 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; send 'tool_choice'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "regex": "'regex' constrained decoding is not supported by the session server",
    "ebnf": "'ebnf' constrained decoding is not supported by the session server",
}


def bad_request(msg: str) -> RequestValidationError:
    """A 400 about one request field (chat_request.py shares these two helpers)."""
    return RequestValidationError(msg)


def is_int(v: object) -> TypeGuard[int]:
    """A JSON integer: Python's bool is an int subclass, but `true` is not a number."""
    return isinstance(v, int) and not isinstance(v, bool)


def _optional_bool(obj: Mapping[str, Any], key: str) -> bool | None:
    """A boolean field, None when absent or null; a truthy string or number is a 400, not a silent True."""
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean")
    return value


def number(obj: Mapping[str, Any], key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    """`obj[key]` as a float in [lo, hi] (or (lo, hi]), None when absent; anything else is a 400 naming the field."""
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or abs(v) > 1e300:
        raise bad_request(f"'{key}' must be a finite number")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad_request(f"'{key}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "function"
    name: str | None = None  # the named function when mode == "function"


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What the request asks beyond sampling: parsed and validated once, read by prompt, engine call and reply."""

    logprobs: bool = False
    top_logprobs: int = 0
    tool_choice: ToolChoice = ToolChoice("auto")
    parallel_tool_calls: bool = True
    response_format: str = "text"  # "text" | "json_object" | "json_schema"
    json_schema: Any = None  # the schema object when response_format == "json_schema"
    chat_template_kwargs: dict[str, Any] | None = None
    include_usage: bool = False
    return_token_ids: bool | None = None  # None: as the server is configured (frontend/token_ids.py)
    tokens_as_token_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: logprob tokens named `token_id:<id>`

    @property
    def parse_tool_calls(self) -> bool:
        """`tool_choice: none` or a JSON response format turns tool-call parsing off (SGLang's
        `_tool_call_parsing_active`): the reply is then content, whatever it looks like."""
        return self.tool_choice.mode != "none" and self.response_format == "text"


# Every field parse_options reads: a request with none of them (most agents' turns) gets the shared defaults.
_OPTION_FIELDS = frozenset({"logprobs", "top_logprobs", "parallel_tool_calls", "response_format", "stream_options",
                            "tool_choice", "chat_template_kwargs", "modalities", token_ids.FIELD,
                            "return_tokens_as_token_ids", *_UNSUPPORTED})
_DEFAULT_OPTIONS = RequestOptions()


def refuse_unsupported(obj: Mapping[str, Any]) -> None:
    for key, why in _UNSUPPORTED.items():
        if obj.get(key) is not None:
            raise bad_request(f"'{key}': {why}")
    modalities = obj.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("'modalities': only [\"text\"] is supported")


def _tool_choice(raw: Any) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request(f"'tool_choice' must be 'auto', 'none', 'required' or a function object, got {raw!r}")
        return ToolChoice(raw)
    if isinstance(raw, dict):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if raw.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise bad_request("'tool_choice' object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return ToolChoice("function", name)
    raise bad_request("'tool_choice' must be a string or an object")


def _check_schema(schema: Any, field: str) -> None:
    if not isinstance(schema, dict):
        raise bad_request(f"'{field}' must be a JSON Schema object")
    try:
        key = msgspec.json.encode(schema, order="sorted")
    except (TypeError, ValueError, RecursionError):
        raise bad_request(f"'{field}' is too deeply nested or contains a cycle") from None
    problem = (_schema_problem if len(key) <= CACHED_SCHEMA_BYTES else _metaschema_problem)(key)
    if problem is not None:
        raise bad_request(f"'{field}' {problem}")


def _metaschema_problem(key: bytes) -> str | None:
    """What is wrong with the JSON Schema `key` (its sorted-key JSON) by the 2020-12 metaschema, or None."""
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError
    except ImportError:  # pragma: no cover - jsonschema is a dependency; keep the shape check at least
        return None
    try:
        Draft202012Validator.check_schema(msgspec.json.decode(key))
    except SchemaError as exc:
        return f"is not a valid JSON Schema: {exc.message}"
    except RecursionError:
        return "is too deeply nested or contains a cycle"
    return None


# One verdict per distinct schema. Checking a schema against the metaschema costs about 1-2 ms (jsonschema resolves
# its $dynamicRefs for every keyword), and every request of an agent carries the same tool schemas: uncached, 8 tools
# were ~90 % of a first turn's CPU and cost every later turn as much again (measured: 6 ms per first-turn prepare).
# Only schemas up to CACHED_SCHEMA_BYTES are remembered, so a client sending ever new large schemas cannot grow the
# cache past SCHEMA_VERDICTS x CACHED_SCHEMA_BYTES (16 MiB).
_schema_problem = functools.lru_cache(maxsize=SCHEMA_VERDICTS)(_metaschema_problem)


def _response_format(raw: Any) -> tuple[str, Any]:
    if raw is None:
        return "text", None
    if not isinstance(raw, dict):
        raise bad_request("'response_format' must be an object")
    kind = raw.get("type")
    if kind == "text":
        return "text", None
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("'response_format.json_schema' must be an object with a 'schema'")
        if not isinstance(spec.get("name", "schema"), str):
            raise bad_request("'response_format.json_schema.name' must be a string")
        schema = spec.get("schema")
        if schema is None:
            raise bad_request("'response_format.json_schema.schema' is required for a json_schema response format")
        _check_schema(schema, "response_format.json_schema.schema")
        return "json_schema", schema
    raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _template_kwargs(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("'chat_template_kwargs' must be an object")
    for key in raw:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"'chat_template_kwargs.{key}' may not be set by a request")
    try:
        json.dumps(raw, allow_nan=False)
    except ValueError:
        raise bad_request("'chat_template_kwargs' must be plain JSON") from None
    return dict(raw) or None


def parse_options(obj: Mapping[str, Any]) -> RequestOptions:
    if obj.keys().isdisjoint(_OPTION_FIELDS):  # what the rest would build, without its ~20 lookups and two objects
        return _DEFAULT_OPTIONS
    refuse_unsupported(obj)
    logprobs = _optional_bool(obj, "logprobs")
    top = obj.get("top_logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top and not logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs': true")
    parallel = _optional_bool(obj, "parallel_tool_calls")
    fmt, schema = _response_format(obj.get("response_format"))
    stream_options = obj.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object")
        include_usage = stream_options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean")
    return RequestOptions(
        logprobs=bool(logprobs), top_logprobs=top or 0, tool_choice=_tool_choice(obj.get("tool_choice")),
        parallel_tool_calls=parallel is not False, response_format=fmt, json_schema=schema,
        chat_template_kwargs=_template_kwargs(obj.get("chat_template_kwargs")), include_usage=include_usage,
        return_token_ids=_optional_bool(obj, token_ids.FIELD),
        tokens_as_token_ids=_optional_bool(obj, "return_tokens_as_token_ids") is True,
    )


_PENALTIES = (
    ("presence_penalty", -2.0, 2.0, False),
    ("frequency_penalty", -2.0, 2.0, False),
    ("repetition_penalty", 0.0, 2.0, True),
    ("min_p", 0.0, 1.0, False),
)
_PENALTY_FIELDS = frozenset({"logit_bias", *(key for key, *_ in _PENALTIES)})


def penalty_params(obj: Mapping[str, Any], sp: dict[str, Any], vocab_size: int | None) -> None:
    """Penalties, `min_p` and `logit_bias` into SGLang sampling keys, with SamplingParams.verify's bounds."""
    if obj.keys().isdisjoint(_PENALTY_FIELDS):
        return
    for key, lo, hi, lo_open in _PENALTIES:
        value = number(obj, key, lo, hi, lo_open=lo_open)
        if value is not None:
            sp[key] = value
    bias = obj.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must be an object of token id -> bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"'logit_bias' may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out: dict[str, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise bad_request(f"'logit_bias' token id {token} is outside the vocabulary [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias[{key}]' must be a number in [-100, 100]")
        out[str(token)] = float(value)
    if out:
        sp["logit_bias"] = out


# -- tools and constraints ------------------------------------------------------------------------------------------


def _tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or []]


def prompt_tools(tools: list[dict[str, Any]] | None, options: RequestOptions) -> list[dict[str, Any]] | None:
    """The tools the chat template renders for this turn (serving_chat `_process_messages`)."""
    choice = options.tool_choice
    if not tools or choice.mode == "none":
        return None
    if choice.mode == "function":
        return [t for t in tools if t["function"]["name"] == choice.name] or None
    return tools


def check_tool_choice(
    tools: list[dict[str, Any]] | None, options: RequestOptions, tools_json: bytes | None = None
) -> None:
    """serving_chat `_validate_request`: a forced choice needs tools, a named one a tool of that name.
    `tools_json`: the JSON `tools` were decoded from, if at hand (the key of their verdict; else they are encoded)."""
    choice = options.tool_choice
    if choice.mode == "required" and not tools:
        raise bad_request("'tool_choice': tools cannot be empty if tool choice is set to required")
    if choice.mode == "function":
        if not tools:
            raise bad_request("'tool_choice': tools cannot be empty if tool choice is set to a specific tool")
        if choice.name not in _tool_names(tools):
            raise bad_request(f"'tool_choice': tool {choice.name!r} not found in tools list")
    if tools and len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' may have at most {MAX_TOOLS} entries, got {len(tools)}")
    if not tools:
        return
    key = msgspec.json.encode(tools) if tools_json is None else tools_json
    problem = (_tools_verdict if len(key) <= CACHED_TOOL_LIST_BYTES else _tools_problem)(key)
    if problem is not None:
        raise bad_request(problem)


def _tools_problem(key: bytes) -> str | None:
    """What is wrong with the tools list `key` (its JSON), or None: its depth and integers as a request body's
    (the chat body decode leaves them to this check, http/body.py), then its parameter schemas."""
    tools = msgspec.json.decode(key)
    try:
        check_json_value({"tools": tools})
    except RequestValidationError as exc:
        return exc.message
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params is not None:
            try:
                _check_schema(params, f"tools[{i}].function.parameters")
            except RequestValidationError as exc:
                return exc.message
    return None


# One verdict per distinct tools list, keyed by its exact JSON (as the chat body carried it, or order-preserving
# compact: cheap to build, and a list that differs in any byte is simply checked again). An agent sends the same
# tools on every turn, so a later turn pays one lookup (one encode where the body's bytes are not at hand) instead of
# a sorted encode and a lookup per schema (the per-schema cache below still serves a list that changed one tool).
# Bounded like the schema cache: at most TOOL_LIST_VERDICTS lists of at most CACHED_TOOL_LIST_BYTES each (16 MiB);
# a larger list is checked every time, so no client can grow it further.
_tools_verdict = functools.lru_cache(maxsize=TOOL_LIST_VERDICTS)(_tools_problem)


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def _strict(tool: dict[str, Any]) -> bool:
    return tool["function"].get("strict") is True


def tool_call_constraint(
    tools: list[dict[str, Any]] | None, options: RequestOptions, call_format: tuple[str, str, str, str] | None,
    native_format: str | None = None,
) -> tuple[str, Any] | None:
    """(sampling key, value) constraining the reply's tool calls, or None (auto with parallel calls allowed).

    `call_format` is the family's (begin prefix, begin suffix, end, trigger) around one call's arguments, e.g.
    Qwen's `<tool_call>\\n{"name":"` + name + `", "arguments":` ... `}\\n</tool_call>` triggered by `<tool_call>`
    (SGLang's Qwen25Detector `structure_info`); None when the family has no such format. `native_format` names the
    family's model-native structural tag (tool_grammar.py), which SGLang prefers where the detector has one.
    """
    choice = options.tool_choice
    if not tools or choice.mode == "none":
        return None
    forced = choice.mode in ("required", "function")
    if not forced and options.parallel_tool_calls:
        return None
    if native_format is not None:
        tag = native_structural_tag(native_format, tools, choice.name if choice.mode == "function" else None,
                                    forced, options.parallel_tool_calls)
        return "structural_tag", json.dumps(tag, ensure_ascii=False)
    # SGLang builds the structure over every tool the request declares, also for a named choice; we narrow it to
    # the named tool, which is what the choice means (the prompt already renders only that tool).
    chosen = [t for t in tools if choice.mode != "function" or t["function"]["name"] == choice.name]
    if call_format is None:
        if not forced:
            raise bad_request("'parallel_tool_calls': false cannot be enforced for this model family")
        items: dict[str, Any] = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": _params_schema(t)},
             "required": ["name", "parameters"]} for t in chosen]}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        if not options.parallel_tool_calls:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema, ensure_ascii=False)
    begin, middle, end, trigger = call_format
    if options.parallel_tool_calls:
        legacy = {
            "type": "structural_tag",
            "structures": [{"begin": begin + t["function"]["name"] + middle,
                            "schema": _params_schema(t) if _strict(t) else {}, "end": end} for t in chosen],
            "triggers": [trigger],
            "at_least_one": forced,
        }
        return "structural_tag", json.dumps(legacy, ensure_ascii=False)
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": [{"begin": begin + t["function"]["name"] + middle,
                      "content": {"type": "json_schema", "json_schema": _params_schema(t) if _strict(t) else {}},
                      "end": end} for t in chosen],
            "at_least_one": forced,
            "stop_after_first": True,
        },
    }
    return "structural_tag", json.dumps(tag, ensure_ascii=False)


def constrain(
    sp: dict[str, Any], tools: list[dict[str, Any]] | None, options: RequestOptions,
    call_format: tuple[str, str, str, str] | None, native_format: str | None = None,
) -> None:
    """Add the constrained-decoding keys, as `ChatCompletionRequest.to_sampling_params` does."""
    if options.response_format == "json_schema":
        sp["json_schema"] = json.dumps(options.json_schema, ensure_ascii=False)
    elif options.response_format == "json_object":
        sp["json_schema"] = '{"type": "object"}'
    constraint = tool_call_constraint(tools, options, call_format, native_format)
    if constraint is None:
        return
    if "json_schema" in sp:
        if options.tool_choice.mode in ("required", "function"):
            raise bad_request("'tool_choice' 'required' or a named tool cannot be combined with 'response_format': the "
                       "tool-call constraint and the output constraint cannot both be honored")
        raise bad_request("'parallel_tool_calls': false cannot be combined with 'response_format'")
    key, value = constraint
    sp[key] = value
