"""The request fields as one table (CHAT_FIELDS), honoured the way SGLang 0.5.23's OpenAI server honours them.

Every field of a chat request is one row: its name, where its value goes (the chat request, its options, or a key of
SGLang's `sampling_params`) and its one rule (type and range), in the order the checks run; refused fields are rows
too, with the reason their 400 gives. One loop reads a request by the table (`read_fields`), so parsing a body stays
in this module, and a new field is one row. Every API's reply limit (Chat's `max_tokens` / `max_completion_tokens`,
Responses' `max_output_tokens`, Messages' `max_tokens`) is the one rule REPLY_LIMIT, whose 400 names the API's own
field. Responses and Messages map their requests onto these fields (their protocol.py); which of their keys are
mapped, ignored or refused is a table of rows too (RESPONSES_KEYS, MESSAGES_KEYS and those of their nested objects).

The fields map to different things -- sampling keys (penalties, `min_p`, `logit_bias`), constrained decoding
(`response_format`, `tool_choice`), what the prompt renders (`tool_choice: none` drops the tools, a named function
keeps only that tool, `chat_template_kwargs` reaches the template), what the reply carries (`logprobs`,
`stream_options`). The reference is `serving_chat.py` / `protocol.py` of the released SGLang:

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgspec

from session_server.frontend import token_ids
from session_server.frontend.tool_grammar import native_structural_tag
from session_server.http.body import check_json_value
from trajectory.errors import RequestValidationError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_LOGIT_BIAS_ENTRIES = 1024
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
def bad_request(msg: str) -> RequestValidationError:
    """A 400 about one request field."""
    return RequestValidationError(msg)


def is_int(v: object) -> TypeGuard[int]:
    """A JSON integer: Python's bool is an int subclass, but `true` is not a number."""
    return isinstance(v, int) and not isinstance(v, bool)


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


_DEFAULT_OPTIONS = RequestOptions()


# -- the rules: what a field's value must be, and what it becomes ------------------------------------------------------
# A rule is called with the field's value (never None: an absent or null field is not read), the field's name as a
# 400 names it, and what it may read beyond its value (`Context`); it returns what goes where its row says, or None
# for nothing.


@dataclass(slots=True)
class Context:
    """What a rule may read beyond its own value: the whole request (top_logprobs needs logprobs) and the
    vocabulary's size (logit_bias), when known."""

    request: Mapping[str, Any]
    vocab_size: int | None = None


NO_CONTEXT = Context({})
Rule = Callable[[Any, str, Context], Any]


@dataclass(frozen=True, slots=True)
class Integer:
    """An integer in [lo, hi] (or -1, where -1 means "no limit")."""

    lo: int
    hi: int
    or_minus_one: bool = False

    def __call__(self, value: Any, label: str, context: Context) -> int:
        if not is_int(value) or not (self.lo <= value <= self.hi or (self.or_minus_one and value == -1)):
            raise bad_request(f"{label} must be an integer in [{self.lo}, {self.hi}]"
                              + (" or -1" if self.or_minus_one else ""))
        return value


@dataclass(frozen=True, slots=True)
class Number:
    """A finite number in [lo, hi] (or (lo, hi]), as a float."""

    lo: float
    hi: float
    lo_open: bool = False

    def __call__(self, value: Any, label: str, context: Context) -> float:
        if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                or abs(value) > 1e300):
            raise bad_request(f"{label} must be a finite number")
        if (value <= self.lo if self.lo_open else value < self.lo) or value > self.hi:
            raise bad_request(f"{label} must be in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}], "
                              f"got {value!r}")
        return float(value)


def boolean(value: Any, label: str, context: Context) -> bool:
    """A boolean; a truthy string or number is a 400, not a silent True."""
    if not isinstance(value, bool):
        raise bad_request(f"{label} must be a boolean")
    return value


def raw(value: Any, label: str, context: Context) -> Any:
    """Passed on as it is: checked where it is used (messages and tools by the trajectory's prepare)."""
    return value


def string_or_none(value: Any, label: str, context: Context) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Refused:
    """A field the server cannot honour: a 400 that says why, never a silent drop."""

    why: str

    def __call__(self, value: Any, label: str, context: Context) -> None:
        raise bad_request(f"{label}: {self.why}")


# What a reply may be long: SGLang's max_new_tokens is an int32. The one check of every API's reply limit (Chat's
# max_tokens and max_completion_tokens, Responses' max_output_tokens, Messages' max_tokens), each 400 naming the
# API's own field.
MAX_INT32 = 2**31 - 1
REPLY_LIMIT = Integer(1, MAX_INT32)


def reply_limit(value: Any, field_name: str, required: bool = False) -> int | None:
    """A reply limit by REPLY_LIMIT (None when absent and not `required`), the 400 naming `field_name`."""
    if value is None and not required:
        return None
    return REPLY_LIMIT(value, f"'{field_name}'", NO_CONTEXT)


def _n(value: Any, label: str, context: Context) -> None:
    if value != 1:
        raise bad_request("only n=1 is supported: a session holds one linear trajectory")


def _modalities(value: Any, label: str, context: Context) -> None:
    if value != ["text"]:
        raise bad_request(f"{label}: only [\"text\"] is supported")


def _top_logprobs(value: Any, label: str, context: Context) -> int:
    top = Integer(0, MAX_TOP_LOGPROBS)(value, label, context)
    if top and not context.request.get("logprobs"):
        raise bad_request(f"{label} requires 'logprobs': true")
    return top


def _stop(value: Any, label: str, context: Context) -> list[str] | None:
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request(f"{label} must be a non-empty string or a list of them")
    if len(stop) > 32:  # SGLang's MAX_STOP_COUNT
        raise bad_request(f"{label} may have at most 32 entries")
    return stop or None


def _seed(value: Any, label: str, context: Context) -> int:
    if not is_int(value) or not -(2**63) <= value < 2**63:
        raise bad_request(f"{label} must be a 64-bit integer")
    return value


def _stream_options(value: Any, label: str, context: Context) -> bool:
    if not isinstance(value, dict):
        raise bad_request(f"{label} must be an object")
    include_usage = value.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean")
    return include_usage


def _tool_choice(value: Any, label: str, context: Context) -> ToolChoice:
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad_request(f"{label} must be 'auto', 'none', 'required' or a function object, got {value!r}")
        return ToolChoice(value)
    if isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise bad_request(f"{label} object must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        return ToolChoice("function", name)
    raise bad_request(f"{label} must be a string or an object")


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


def _response_format(value: Any, label: str, context: Context) -> tuple[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{label} must be an object")
    kind = value.get("type")
    if kind == "text":
        return "text", None
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        spec = value.get("json_schema")
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


def _template_kwargs(value: Any, label: str, context: Context) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        raise bad_request(f"{label} must be an object")
    for key in value:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"'chat_template_kwargs.{key}' may not be set by a request")
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise bad_request(f"{label} must be plain JSON") from None
    return dict(value) or None


def _logit_bias(value: Any, label: str, context: Context) -> dict[str, float] | None:
    """Token id -> bias; the ids within the vocabulary, when its size is known."""
    if not isinstance(value, dict):
        raise bad_request(f"{label} must be an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"{label} may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    vocab_size = context.vocab_size
    out: dict[str, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10):
            raise bad_request(f"{label} keys must be token ids, got {key!r}")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise bad_request(f"{label} token id {token} is outside the vocabulary [0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise bad_request(f"'logit_bias[{key}]' must be a number in [-100, 100]")
        out[str(token)] = float(bias)
    return out or None


# -- the table ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Field:
    """One request field: its name, where its value goes and its one rule.

    `to` is "request.<attr>" (the chat request itself), "options.<attr>" (RequestOptions), "sampling.<key>"
    (SGLang's `sampling_params`), several of them for a rule that returns as many values, or nothing for a field that
    is only checked. `label` is how a 400 names the field, when not by its name alone."""

    name: str
    to: tuple[str, ...]
    rule: Rule
    label: str = ""


def _field(name: str, to: str, rule: Rule, label: str = "") -> Field:
    return Field(name, tuple(to.split()), rule, label or f"'{name}'")


def _refused(name: str, why: str) -> Field:
    return _field(name, "", Refused(why))


_CHAT_LIMIT = "'max_tokens' / 'max_completion_tokens'"

# Every field of a Chat Completions request the server reads, in the order its checks run (the first broken rule is
# the 400). Responses and Messages map their requests onto these (their protocol.py), so every API honours a field the
# same way. A field not here has no effect on the turn (OpenAI's `user`, `metadata`, `store`, ...); a new field is one
# row.
CHAT_FIELDS: tuple[Field, ...] = (
    _field("n", "", _n),
    _field("stream", "request.stream", boolean),
    _field("model", "request.model", string_or_none),
    _field("messages", "request.messages", raw),
    _field("tools", "request.tools", raw),
    _refused("functions", "the legacy 'functions' field is not supported; send 'tools'"),
    _refused("function_call", "the legacy 'function_call' field is not supported; send 'tool_choice'"),
    _refused("audio", "audio output is not supported"),
    _refused("prediction", "predicted outputs are not supported"),
    _refused("web_search_options", "web search is not supported"),
    _refused("regex", "'regex' constrained decoding is not supported by the session server"),
    _refused("ebnf", "'ebnf' constrained decoding is not supported by the session server"),
    _field("modalities", "", _modalities),
    _field("logprobs", "options.logprobs", boolean),
    _field("top_logprobs", "options.top_logprobs", _top_logprobs),
    _field("parallel_tool_calls", "options.parallel_tool_calls", boolean),
    _field("response_format", "options.response_format options.json_schema", _response_format),
    _field("stream_options", "options.include_usage", _stream_options),
    _field("tool_choice", "options.tool_choice", _tool_choice),
    _field("chat_template_kwargs", "options.chat_template_kwargs", _template_kwargs),
    _field(token_ids.FIELD, "options.return_token_ids", boolean),
    _field("return_tokens_as_token_ids", "options.tokens_as_token_ids", boolean),
    # max_completion_tokens wins over max_tokens: a row whose place an earlier row filled is not read.
    _field("max_completion_tokens", "sampling.max_new_tokens", REPLY_LIMIT, _CHAT_LIMIT),
    _field("max_tokens", "sampling.max_new_tokens", REPLY_LIMIT, _CHAT_LIMIT),
    _field("temperature", "sampling.temperature", Number(0, 1e6)),
    _field("top_p", "sampling.top_p", Number(0, 1, lo_open=True)),
    _field("top_k", "sampling.top_k", Integer(1, MAX_INT32, or_minus_one=True)),
    _field("stop", "sampling.stop", _stop),
    _field("seed", "sampling.sampling_seed", _seed),
    # Penalties, min_p and logit_bias with SamplingParams.verify's bounds.
    _field("presence_penalty", "sampling.presence_penalty", Number(-2.0, 2.0)),
    _field("frequency_penalty", "sampling.frequency_penalty", Number(-2.0, 2.0)),
    _field("repetition_penalty", "sampling.repetition_penalty", Number(0.0, 2.0, lo_open=True)),
    _field("min_p", "sampling.min_p", Number(0.0, 1.0)),
    _field("logit_bias", "sampling.logit_bias", _logit_bias),
)


@dataclass(slots=True)
class ChatFields:
    """A chat request's fields as the table reads them."""

    request: dict[str, Any]  # stream, model, messages, tools
    sampling: dict[str, Any]  # SGLang's sampling_params
    options: RequestOptions


# The table as read: a field's row by its name, and each row's places as (place's index in PLACES, key) pairs.
PLACES = ("request", "sampling", "options")
_ROW = {row.name: i for i, row in enumerate(CHAT_FIELDS)}
_PLACES = tuple(tuple((PLACES.index(place), key) for place, _, key in (to.partition(".") for to in row.to))
                for row in CHAT_FIELDS)


def read_fields(obj: Mapping[str, Any], stop_token_ids: tuple[int, ...],
                vocab_size: int | None = None) -> ChatFields:
    """Every field of CHAT_FIELDS present (and not null) in `obj`, by its rule, in the table's order: only the rows
    of the fields the request has are visited (an agent's turn carries a handful)."""
    places: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = (
        {"stream": False, "model": None, "messages": None, "tools": None},
        # tool-call markup of some families is made of special tokens; no max_tokens from the agent is an explicit
        # null, as SGLang's own chat endpoint sends (up to the context length): left out it would be 128 tokens.
        {"stop_token_ids": list(stop_token_ids), "skip_special_tokens": False, "no_stop_trim": False,
         "max_new_tokens": None},
        {},
    )
    context = Context(obj, vocab_size)
    filled: set[tuple[int, str]] = set()
    rows = [i for i in map(_ROW.get, obj) if i is not None]
    rows.sort()
    for i in rows:
        row, to = CHAT_FIELDS[i], _PLACES[i]
        value = obj[row.name]
        if value is None or (to and to[0] in filled):
            continue
        out = row.rule(value, row.label, context)
        if len(to) == 1:
            filled.add(to[0])
            if out is not None:
                places[to[0][0]][to[0][1]] = out
        elif to:
            filled.update(to)
            for (place, key), got in zip(to, out, strict=True):
                if got is not None:
                    places[place][key] = got
    request, sampling, options = places
    return ChatFields(request, sampling, RequestOptions(**options) if options else _DEFAULT_OPTIONS)


# -- the keys of a Responses or Messages request ----------------------------------------------------------------------
# Their protocol.py map what they honour onto the chat fields above. What each key of theirs is -- mapped there,
# accepted without effect on the tokens (reported in the turn's `ignored`: Claude Code sends betas and cache hints on
# every turn and answers a 400 by retrying without features), or refused with a 400 that says why -- is one row of
# the object's table below; a key without a row is a 400 that names it. A new key is one row.


def _not_null(value: Any) -> bool:
    return value is not None


def _present(value: Any) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a request object. `action`: "mapped" (read by the API's protocol.py), "ignored" (reported in
    `ignored`) or "refused" (a 400 with `why`), the last two when `when(value)` holds (by default: the value is not
    null)."""

    name: str
    action: str = "mapped"
    why: str = ""
    when: Callable[[Any], bool] = _not_null


def ignored(name: str, when: Callable[[Any], bool] = _not_null) -> Key:
    return Key(name, "ignored", when=when)


def refused(name: str, why: str, when: Callable[[Any], bool] = _not_null) -> Key:
    return Key(name, "refused", why, when)


def mapped(*names: str) -> tuple[Key, ...]:
    return tuple(Key(name) for name in names)


@dataclass(frozen=True, slots=True)
class Keys:
    """The table of one request object: its rows, the 400 of a key without one (`unknown`), and how `ignored` names
    a key of it (`report`: a prefix such as "text.")."""

    rows: tuple[Key, ...]
    unknown: str = "is not supported"
    report: str = ""

    def read(self, obj: Mapping[str, Any], where: str = "") -> list[str]:
        """The keys of `obj` this table ignores (as `report` names them), after the checks: a key without a row, then
        every refusal in the table's order, is a 400 naming `where.key` (the key alone at the top level)."""
        rows = {row.name: row for row in self.rows}
        for key in obj:
            if key not in rows:
                raise bad_request(f"'{where}{'.' if where else ''}{key}' {self.unknown}")
        for row in self.rows:
            if row.action == "refused" and row.name in obj and row.when(obj[row.name]):
                raise bad_request(f"'{where}{'.' if where else ''}{row.name}' {row.why}")
        return [self.report + row.name for row in self.rows
                if row.action == "ignored" and row.name in obj and row.when(obj[row.name])]


# A Responses request. Accepted without effect on the tokens: what OpenAI stores, bills or routes by.
RESPONSES_KEYS = Keys((
    *mapped("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
            "temperature", "top_p", "reasoning", "text", "include", "previous_response_id", "stream",
            "return_token_ids"),
    refused("background", "is not supported: a session turn runs in the foreground", when=bool),
    refused("conversation", "is not supported: the session is the conversation (or use previous_response_id)"),
    refused("prompt", "templates are not supported"),
    refused("truncation", "only 'disabled' is supported: a trajectory is never truncated silently",
            when=lambda value: value not in (None, "disabled")),
    refused("max_tool_calls", "is not supported"),
    refused("top_logprobs", "is not supported on the Responses API; use chat completions", when=bool),
    *(ignored(name) for name in ("store", "metadata", "user", "safety_identifier", "prompt_cache_key",
                                 "prompt_cache_retention", "service_tier", "stream_options", "client_metadata")),
), unknown="is not a Responses API field this server knows")
RESPONSES_TEXT_KEYS = Keys((Key("format"), ignored("verbosity", when=_present)), report="text.")

# A Messages request. Accepted without effect on the tokens: cache hints, betas, what Anthropic bills or routes by.
MESSAGES_KEYS = Keys((
    *mapped("model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream",
            "tools", "tool_choice", "thinking", "output_config"),
    refused("container", "is not supported"),
    refused("mcp_servers", "is not supported"),
    *(ignored(name) for name in ("cache_control", "metadata", "context_management", "service_tier", "speed",
                                 "inference_geo", "diagnostics", "betas", "user_profile_id", "workspace_id")),
), unknown="is not a Messages API field this server knows")
MESSAGES_OUTPUT_CONFIG_KEYS = Keys((Key("format"), ignored("effort", when=_present),
                                    ignored("task_budget", when=_present)), report="output_config.")
MESSAGES_TOOL_KEYS = Keys((
    *mapped("type", "name", "description", "input_schema", "strict"),
    *(ignored(name, when=_present) for name in ("cache_control", "defer_loading", "eager_input_streaming",
                                                "input_examples")),
), report="tools.")


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
