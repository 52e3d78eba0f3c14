"""A `/generate` request: its validated input and its life inside the engine.

Why validation lives here and not in the HTTP handler: SGLang rejects a bad request before it is scheduled, with a
400 and a message; doing the same in one place keeps the scheduler free of type checks.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from sglang_sim.constraints import ConstraintError, parse_json_schema, parse_structural_tag
from sglang_sim.generation import ReplyPlan, SamplingParams
from sglang_sim.images import SimImage, image_sources
from sglang_sim.radix_cache import Node
from sglang_sim.serde_display import unexpected
from sglang_sim.sessions import EngineSession, SessionParams

_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY_F = np.zeros(0, dtype=np.float32)


class BadRequest(Exception):
    """A request SGLang would refuse with HTTP 400 and `{"error": {"message": ...}}`."""


class ValueRefusal(BadRequest):
    """A request SGLang refuses past its HTTP layer, in the tokenizer manager (SamplingParams.verify's ranges, a
    prompt or budget past the context): a ValueError there, which http_server.py answers 400 for a plain request and,
    for a streamed one, HTTP 200 with an error event then `[DONE]` (`stream_results`)."""


class ContractError(BadRequest):
    """A `/generate` body that breaks SGLang's JSON contract (sglang/api/v1/api_types.py: unknown keys, wrong JSON
    types), which SGLang refuses before anything else with HTTP 400 and `{"error": "<the contract's text>"}`."""


class FieldValidationError(BadRequest):
    """A `/generate` field that FastAPI's parse of GenerateReqInput (pydantic, lax types) refuses before the contract
    gate sees the body: http_server.py `validation_exception_handler` answers HTTP 400 with the OpenAI-style
    ErrorResponse, its message FastAPI's text of the error."""


@dataclass(frozen=True)
class GenerateInput:
    rid: str
    input_ids: np.ndarray | None
    text: str | None
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_params: SessionParams | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routing_key: str | None = None
    require_reasoning: bool = False  # hold a grammar back until the reasoning ends (with --reasoning-parser)
    image_data: tuple[str, ...] = ()  # the images (data URLs, base64), decoded at submission (sglang_sim/images.py)
    return_prompt_token_ids: bool = False  # the reply carries `prompt_token_ids`: the prompt with images expanded
    return_sampling_mask: bool = False  # the reply carries the kept ids per output token (sampling_masks.py)
    sampling_logprobs_mode: str | None = None  # "selected" (the default with masks) or "support"
    extra_key: str | None = None  # the radix cache's namespace (SGLang's `extra_key`; "" is none)
    lora_path: str | None = None  # the LoRA adapter by its loaded name (sglang_sim/lora.py); None: the base model


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(d: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    v = d.get(key)
    if v is None:
        return default
    if kind is int and not _is_int(v):
        raise ContractError(f"invalid type: {unexpected(v)}, expected i64")
    if kind is float and (isinstance(v, bool) or not isinstance(v, int | float)):
        raise ContractError(f"invalid type: {unexpected(v)}, expected f64")
    if kind not in (int, float) and not isinstance(v, kind):
        raise BadRequest(f"{key} has the wrong type")
    return v


# SGLang 0.5.23's SamplingParams keys (sglang.api.v1.SamplingParams rejects any other key with a 400).
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
_NOT_EMULATED = ("stop_regex", "regex", "ebnf", "beam_width", "choice", "watermark")


def _bounded(raw: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    """A float sampling key with SamplingParams.verify's bounds."""
    v = float(_opt(raw, key, float, default))
    if not math.isfinite(v) or (v <= lo if lo_open else v < lo) or v > hi:
        raise BadRequest(f"{key} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}.")
    return v


def _logit_bias(raw: Any, vocab_size: int) -> dict[int, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequest("logit_bias must be a map of token id -> bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key.lstrip("-").isdigit():
            raise BadRequest(f"logit_bias key {key!r} is not a token id")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise BadRequest(f"logit_bias must has keys in [0, {vocab_size}), got {token}.")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadRequest("logit_bias values must be finite numbers")
        out[token] = float(value)
    return out


def parse_sampling(raw: Any, vocab_size: int = 1 << 30) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object")
    for key in raw:
        if key not in SAMPLING_KEYS:
            raise ContractError(
                f"unknown field `{key}`, expected one of {', '.join(f'`{k}`' for k in SAMPLING_KEYS)}")
    for key in _NOT_EMULATED:
        if raw.get(key) not in (None, [], {}):
            raise BadRequest(f"sglang-sim does not emulate the sampling parameter {key!r}")
    n = _opt(raw, "n", int, 1)
    if n != 1:
        raise BadRequest("sglang-sim emulates n=1 only")
    grammars = [k for k in ("json_schema", "structural_tag") if raw.get(k)]
    if len(grammars) > 1:
        raise BadRequest("Only one of regex, json_schema, ebnf, or structural_tag can be set.")
    try:
        schema = parse_json_schema(_opt(raw, "json_schema", str, "")) if raw.get("json_schema") else None
        tag = parse_structural_tag(_opt(raw, "structural_tag", str, "")) if raw.get("structural_tag") else None
    except ConstraintError as exc:
        raise BadRequest(str(exc)) from None
    top_k = _opt(raw, "top_k", int, -1)
    if top_k < 1 and top_k != -1:
        raise BadRequest(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    stop = raw.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("stop must be a string or a list of strings")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers")
    # Absent: SGLang's SamplingParams default, 128. Explicit null (what SGLang's own chat endpoint sends when the
    # client gives no limit): up to the context length, resolved at submission (scheduler init_req_max_new_tokens).
    max_new = None if "max_new_tokens" in raw and raw["max_new_tokens"] is None else _opt(
        raw, "max_new_tokens", int, 128)
    if max_new is not None and max_new < 0:  # sampling_params.py SamplingParams.verify's texts
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
    temperature = _opt(raw, "temperature", float, 1.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}.")
    temperature = float(temperature)
    seed = _opt(raw, "sampling_seed", int, None)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise BadRequest("sampling_seed must be a 64-bit integer")
    return SamplingParams(
        stream_interval=_opt(raw, "stream_interval", int, None),
        max_new_tokens=max_new, temperature=temperature, stop=stops, stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(raw.get("ignore_eos", False)), no_stop_trim=bool(raw.get("no_stop_trim", False)),
        skip_special_tokens=bool(raw.get("skip_special_tokens", True)), sampling_seed=seed,
        top_p=_bounded(raw, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=top_k,
        min_p=_bounded(raw, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_bounded(raw, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_bounded(raw, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_bounded(raw, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        logit_bias=_logit_bias(raw.get("logit_bias"), vocab_size), json_schema=schema, structural_tag=tag)


def parse_generate(body: Any, vocab_size: int, routing_key: str | None) -> GenerateInput:
    """Validate a `/generate` JSON body (single request; batches are not emulated)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    ids = body.get("input_ids")
    text = body.get("text")
    if (ids is None) == (text is None):
        raise BadRequest("Either text or input_ids should be provided.")
    input_ids = None
    if ids is not None:
        try:
            checked = msgspec.convert(ids, list[int])  # strict: rejects bools, floats and nested lists
        except msgspec.ValidationError as exc:
            raise BadRequest(f"input_ids must be a list of integers (batched requests are not supported): {exc}"
                             ) from None
        try:
            arr = np.asarray(checked, dtype=np.int64)
        except OverflowError:
            arr = np.asarray([-1], dtype=np.int64)
        if len(arr) and (arr.min() < 0 or arr.max() >= vocab_size):
            raise BadRequest(f"input_ids contain a token id outside [0, {vocab_size})")
        input_ids = arr.astype(np.int32)
    elif not isinstance(text, str):
        raise BadRequest("text must be a string (batched requests are not supported)")
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    try:
        images = image_sources(body.get("image_data"))
    except TypeError as exc:
        raise ContractError(str(exc)) from None
    sp = body.get("session_params")
    session = None
    if sp is not None:
        if not isinstance(sp, dict) or not isinstance(sp.get("id"), str):
            raise BadRequest("session_params must be an object with a string id")
        session = SessionParams(id=sp["id"], rid=sp.get("rid"), offset=_opt(sp, "offset", int, None),
                                replace=bool(sp.get("replace") or False),
                                drop_previous_output=bool(sp.get("drop_previous_output") or False))
    try:
        sampling = parse_sampling(body.get("sampling_params"), vocab_size)
    except ContractError:
        raise
    except BadRequest as exc:
        raise ValueRefusal(str(exc)) from None
    extra_key = body.get("extra_key")
    if extra_key is not None and not isinstance(extra_key, str):
        raise BadRequest("extra_key must be a string")
    lora_path = body.get("lora_path")
    if lora_path is not None and not isinstance(lora_path, str):
        raise BadRequest("sglang-sim: lora_path must be one adapter name (a string)")
    return GenerateInput(
        rid=rid, extra_key=extra_key or None, lora_path=lora_path, input_ids=input_ids, text=text, sampling=sampling,
        return_logprob=bool(body.get("return_logprob", False)),
        logprob_start_len=_opt(body, "logprob_start_len", int, -1),
        top_logprobs_num=_opt(body, "top_logprobs_num", int, 0),
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
        stream=bool(body.get("stream", False)), session_params=session,
        return_routed_experts=bool(body.get("return_routed_experts", False)),
        routed_experts_start_len=_opt(body, "routed_experts_start_len", int, 0), routing_key=routing_key,
        require_reasoning=_request_bool(body, "require_reasoning"), image_data=images,
        return_prompt_token_ids=_request_bool(body, "return_prompt_token_ids"),
        return_sampling_mask=_request_bool(body, "return_sampling_mask"),
        sampling_logprobs_mode=_logprobs_mode(body))


def _logprobs_mode(body: dict[str, Any]) -> str | None:
    """`sampling_logprobs_mode` (io_struct.py: a Literal FastAPI's parse checks), which the tokenizer manager then
    allows only with `return_sampling_mask`."""
    mode = body.get("sampling_logprobs_mode")
    if mode is not None and mode not in ("selected", "support"):
        error = {"type": "literal_error", "loc": ("body", "sampling_logprobs_mode"),
                 "msg": "Input should be 'selected' or 'support'", "input": mode}
        raise FieldValidationError(f'1 validation error:\n  {error!r}\n\n  File "sglang/srt/entrypoints/'
                                   f'http_server.py", line 928, in generate_request\n    POST /generate [{error!r}]')
    if mode is not None and body.get("return_sampling_mask") is not True:
        raise ValueRefusal("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    return mode


# pydantic's lax booleans: the strings (any case) FastAPI's parse of a `bool` field takes for true or false.
_LAX_BOOLS = frozenset({"1", "on", "t", "true", "y", "yes", "0", "off", "f", "false", "n", "no"})


def _request_bool(body: dict[str, Any], key: str) -> bool:
    """A `bool` field of GenerateReqInput (absent: false), checked twice as SGLang does: FastAPI's pydantic parse
    refuses what is no lax boolean (null included) with its own 400, then the contract gate refuses whatever it let
    through that is not a JSON boolean (`"yes"`, `1`) with the contract's text."""
    if key not in body:
        return False
    value = body[key]
    if isinstance(value, bool):
        return value
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if (isinstance(value, str) and value.lower() in _LAX_BOOLS) or (whole and value in (0, 1)):
        raise ContractError(f"invalid type: {unexpected(value)}, expected a boolean")
    kind, msg = (("bool_parsing", "Input should be a valid boolean, unable to interpret input")
                 if isinstance(value, str) or whole else ("bool_type", "Input should be a valid boolean"))
    error = {"type": kind, "loc": ("body", key), "msg": msg, "input": value}
    raise FieldValidationError(f'1 validation error:\n  {error!r}\n\n  File "sglang/srt/entrypoints/http_server.py", '
                               f"line 928, in generate_request\n    POST /generate [{error!r}]")


@dataclass(eq=False)
class SimRequest:
    """A request from submission to its last response; owns its KV between admission and release."""

    inp: GenerateInput
    prompt: np.ndarray
    plan: ReplyPlan
    session: EngineSession | None
    # The radix-cache key of the prompt: the prompt itself, except that each image's pads are one value derived from
    # the image's bytes (sglang_sim/images.py), so the cache tells images apart as SGLang's does.
    key: np.ndarray | None = None
    images: tuple[SimImage, ...] = ()  # the images the prompt's pads expanded to
    namespace: int = 0  # the radix cache's partition for the request's `extra_key` and adapter (0: none)
    lora_seed: int | None = None  # the request's adapter as its replies' seed (sglang_sim/lora.py); None: base
    # Per output token, what the engine's weights and the KV the token was sampled on add to the planned logprob
    # (Engine.logprob_shift): zero under the engine's first weights on KV of those weights.
    shift: np.ndarray = field(default_factory=lambda: _EMPTY_F)
    created: float = field(default_factory=time.perf_counter)
    state: str = "waiting"  # waiting | running | finished
    generated: int = 0
    cached_tokens: int = 0
    retractions: int = 0
    abort_message: str | None = None
    # The output index whose sampling support overflows the mask cap (the fault mask_overflow): the request ends
    # there with `overflow` as its finish reason (sampling_masks.overflow_abort), that token not emitted.
    overflow_at: int | None = None
    overflow: dict[str, Any] | None = None
    aborted_waiting: bool = False  # aborted before it was scheduled: answered with the reduced queued-abort shape
    weight_events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens generated by then)
    finish_reason: dict[str, Any] | None = None
    finished_at: float | None = None
    # KV owned while admitted: a locked radix prefix plus private slots for everything after it.
    node: Node | None = None
    prefix_len: int = 0
    admitted_cached: int = 0  # tokens whose KV was reused at the latest admission (prefill skips them)
    private: np.ndarray = field(default_factory=lambda: _EMPTY)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def rid(self) -> str:
        return self.inp.rid

    @property
    def params(self) -> SamplingParams:
        return self.inp.sampling

    @property
    def content_key(self) -> np.ndarray:
        """The prompt with each image's pads as its content key: what the reply depends on."""
        return self.prompt if self.key is None else self.key

    @property
    def cache_key(self) -> np.ndarray:
        """The prompt as the radix cache keys it: the content key, moved into the `extra_key`'s partition (ids
        offset by the partition's number, so no entry of one partition is a prefix of another's)."""
        return self.in_namespace(self.content_key)

    def in_namespace(self, ids: np.ndarray) -> np.ndarray:
        if not self.namespace:
            return ids
        return ((ids.astype(np.int64) + (self.namespace << 21)) % (1 << 31)).astype(np.int32)

    @property
    def logprobs(self) -> np.ndarray:
        """The planned logprobs as emitted: plus the weights' and the KV's shift (`shift`)."""
        planned = self.plan.logprobs
        if not len(self.shift):
            return planned
        return (planned + self.shift[: len(planned)]).astype(np.float32)

    @property
    def kv_tokens(self) -> np.ndarray:
        """Tokens whose KV the request computes, as the cache keys them: prompt + output, minus the last token (never
        fed back)."""
        full = np.concatenate([self.cache_key, self.in_namespace(self.plan.output_ids)])
        return full[:-1] if len(full) else full

    @property
    def image_tokens(self) -> int:
        """The prompt's pads that are images (SGLang's meta_info `image_tokens`)."""
        return sum(image.tokens for image in self.images)

    @property
    def output_ids(self) -> np.ndarray:
        return self.plan.output_ids[: self.generated]

    def interrupt(self) -> None:
        self.wakeup.set()
