"""Strict, fast decoding of SGLang's native `/generate` response (docs/design.md 5.3).

Nothing the engine says is recorded before it passes these rules, because a bad token id or a NaN
logprob silently poisons a training batch. The schema is a set of typed msgspec Structs, so type
rules (int-not-bool, finite numbers, 2-or-3-item entries, the finish-reason shapes) are enforced in C
while decoding, and the routed-experts payload (often megabytes) is kept as raw bytes, never parsed.

Two paths, one verdict. The fast path decodes SGLang's own shape with the per-token value rules (a logprob float32
can hold, a token id inside the vocabulary) written into the schema as msgspec constraints, checked in C as each
number is read, so a good reply needs no numpy reduction: two column reads straight into the stored dtypes and one
bytes comparison (the entries' ids, encoded compactly, against `output_ids` as the engine wrote it, which is not
decoded into a second list of ints unless it was written otherwise). It never rejects: whatever does not pass it
goes to the strict path (`_decode_strictly`), which decides and names the broken rule, and which the property tests
hold the fast path to on valid and broken bodies. What is left is msgspec building a tuple, a float and an int per
token: parsing the numbers outside msgspec (a regex over the bytes, numpy's text parsers) costs more than that here,
not less.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Annotated, Any, Generic, TypeVar

import msgspec
import numpy as np

from .errors import UpstreamError
from .sampling_masks import SamplingMasks

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _Stop(msgspec.Struct, tag_field="type", tag="stop"):
    matched: int | str | None = None


class _Length(msgspec.Struct, tag_field="type", tag="length"):
    length: int


class _Abort(msgspec.Struct, tag_field="type", tag="abort"):
    message: str | None
    status_code: int | None = None  # set when the abort has a reason of its own (a timeout's 503, a 400)


class _LogprobEntry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """`[logprob, token_id]` or `[logprob, token_id, token_text_or_null]`."""

    logprob: float
    token_id: int
    text: str | None = None


class _WeightSpan(msgspec.Struct, forbid_unknown_fields=True):
    """One of `meta_info.weight_versions` (sglang/srt/utils/weight_versions.py add_weight_versions_to_meta_info):
    output tokens [start, end) were sampled with weights `version`."""

    version: str
    start: NonNegative
    end: NonNegative


# SGLang's own entry shape: `(logprob, token_id, None)` (tokenizer_manager.py detokenize_logprob_tokens without
# return_text_in_logprobs). Decoded as plain tuples first: a Struct per token costs twice as much, and a body that
# does not fit this narrower type is decoded again with `_LogprobEntry`, which decides (and names the broken rule).
_PlainEntry = tuple[float, int, None]
Entry = TypeVar("Entry")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# The fast path's logprob: a float whose magnitude float32 can hold (the strict path's `logprob_value` rule).
_Float32 = Annotated[float, msgspec.Meta(ge=-_FLOAT32_MAX, le=_FLOAT32_MAX)]


class _MetaInfo(msgspec.Struct, Generic[Entry], kw_only=True):
    finish_reason: _Stop | _Length | _Abort
    completion_tokens: NonNegative
    # Required, except in the reduced meta_info of a request aborted in the engine's waiting queue
    # (tokenizer_manager.py _handle_abort_req): checked after the finish reason is known.
    prompt_tokens: NonNegative | None = None
    output_token_logprobs: list[Entry]
    output_top_logprobs: list[list[_LogprobEntry] | None] | None = None  # when top_logprobs_num > 0
    cached_tokens: NonNegative = 0
    id: str | None = None
    weight_version: str | int | None = None
    weight_versions: list[_WeightSpan] | None = None
    e2e_latency: float | None = None
    routed_experts: msgspec.Raw = msgspec.Raw(b"")
    # With `return_sampling_mask` (mode "selected"): per output token the kept ids and the sampled token's logprob
    # normalised over them (sampling_masks.py checks them when the request asked for them).
    output_token_sampling_mask: list[list[int]] | None = None
    output_token_sampling_logprobs: list[float] | None = None


class _GenerateResponse(msgspec.Struct, Generic[Entry]):
    text: str
    output_ids: list[int]
    meta_info: _MetaInfo[Entry]


class _FastResponse(msgspec.Struct, Generic[Entry]):
    """The fast path's body: `output_ids` kept as the engine wrote it, to be compared with the entries' ids as bytes
    (SGLang's orjson writes them compactly, as msgspec does) instead of decoded into a second list of ints."""

    text: str
    output_ids: msgspec.Raw
    meta_info: _MetaInfo[Entry]


_PLAIN_DECODER = msgspec.json.Decoder(_GenerateResponse[_PlainEntry])
_DECODER = msgspec.json.Decoder(_GenerateResponse[_LogprobEntry])
_OUTPUT_IDS = msgspec.json.Decoder(list[int])
_ENCODE = msgspec.json.Encoder().encode
_PLAIN_COLUMNS = (itemgetter(0), itemgetter(1))
_ENTRY_COLUMNS = (attrgetter("logprob"), attrgetter("token_id"))
_INT32_IDS = 2**31  # the fast path stores ids straight into int32: only for vocabularies int32 can index
NAN_MATCHED = "NaN happened"  # schedule_batch.py Req._check_vocab_boundary_finish: a NaN sample
_PATH = re.compile(r"at `\$((?:\.\w+|\[\d+\])*)`")
_MISSING = re.compile(r"missing required field `(\w+)`")
# Which docs/design.md 5.3 rule a schema failure breaks, by the JSON path msgspec reports (first match wins).
_RULES_BY_PATH: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^\.meta_info\.output_token_logprobs\[\d+\]\[0\]"), "logprob_value"),
    (re.compile(r"^\.meta_info\.output_token_logprobs\[\d+\]\[1\]"), "token_id_type"),
    (re.compile(r"^\.meta_info\.output_token_logprobs\[\d+\]"), "logprob_entry"),
    (re.compile(r"^\.meta_info\.output_token_logprobs"), "output_token_logprobs"),
    (re.compile(r"^\.meta_info\.output_token_sampling_"), "sampling_mask"),
    (re.compile(r"^\.meta_info\.finish_reason"), "finish_reason"),
    (re.compile(r"^\.meta_info\.completion_tokens"), "completion_tokens"),
    (re.compile(r"^\.meta_info"), "meta_info"),
    (re.compile(r"^\.output_ids"), "output_ids"),
)


def _schema_rule(message: str) -> str:
    match = _PATH.search(message)
    path = match.group(1) if match else ""
    if missing := _MISSING.search(message):  # a missing field breaks the rule of that field
        path += "." + missing.group(1)
    if not match and message.startswith("Expected `array` of at most length"):
        return "logprob_entry"  # msgspec omits the path for too-long array-like structs (only our entries)
    for pattern, rule in _RULES_BY_PATH:
        if pattern.search(path):
            return rule
    return "schema"


@dataclass(frozen=True, slots=True, eq=False)
class GenerateResult:
    """A validated engine result: everything needed to commit a turn and answer the client."""

    text: str
    output_ids: np.ndarray       # int32, includes the stop token when there is one
    logprobs: np.ndarray         # float32, aligned with output_ids
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None
    rid: str | None = None
    routed_experts: bytes | memoryview | None = None  # raw JSON text of the replay payload, never parsed here
    # Per output token, the engine's top (logprob, token id) alternatives (only when they were asked for).
    top_logprobs: list[list[tuple[float, int]]] | None = None
    # Which weights sampled which output tokens: (version, start, end) spans covering [0, completion_tokens).
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    # Per output token, the ids the sampler kept and the sampled token's logprob over them (when asked for).
    sampling_masks: SamplingMasks | None = None
    # How the turn used an engine session (--engine-sessions; None without): ENGINE_SESSION_MODES.
    engine_session: str | None = None
    # The LoRA adapter and its revision that sampled every output token (set by the server, which pins them per
    # session; None, None: the base model).
    adapter: str | None = None
    adapter_revision: str | None = None


# "reused": only the tokens past what the engine session held were sent; "opened": a fresh engine session got the whole
# prompt; "deferred": the turn reused nothing of the trajectory (its first turn, a full render), so none was opened and
# the whole prompt was sent as without the flag (its KV left to the engine's radix cache for the next turn's open);
# "without": none could be opened in time, so the whole history was sent and prefilled without one.
ENGINE_SESSION_MODES = ("reused", "opened", "deferred", "without")


def _finish_reason(reason: _Stop | _Length | _Abort) -> dict[str, Any]:
    if isinstance(reason, _Stop):
        return {"type": "stop", "matched": reason.matched}
    if isinstance(reason, _Length):
        return {"type": "length", "length": reason.length}
    if reason.status_code is None:
        return {"type": "abort", "message": reason.message}
    return {"type": "abort", "message": reason.message, "status_code": reason.status_code}


def _decode(body: bytes) -> _GenerateResponse[Any]:
    """The plain-tuple decode, or the full schema's verdict where the body does not fit it."""
    try:
        return _PLAIN_DECODER.decode(body)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as exc:  # includes NaN/Infinity literals, which are not JSON
        raise _not_json(exc) from None
    try:
        return _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise UpstreamError(f"engine response breaks the schema: {exc}", rule=_schema_rule(str(exc))) from None
    except msgspec.DecodeError as exc:  # malformed past the point where the plain decode stopped
        raise _not_json(exc) from None


def _not_json(exc: msgspec.DecodeError) -> UpstreamError:
    return UpstreamError(f"engine response is not valid JSON: {exc}", rule="json")


@functools.lru_cache(maxsize=16)
def _fast_decoder(vocab_size: int) -> msgspec.json.Decoder[_FastResponse[Any]]:
    """SGLang's entry shape with the value rules as constraints: `(float32-sized logprob, id in the vocabulary,
    null)`. One decoder per vocabulary size (a process serves one or a few)."""
    token_id = Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]
    return msgspec.json.Decoder(_FastResponse[tuple[_Float32, token_id, None]])


def decode_generate_response(body: bytes, vocab_size: int, sampling_mask_bound: int | None = None) -> GenerateResult:
    """Decode and validate one `/generate` body; raise UpstreamError(rule=...) on the first broken rule.

    `sampling_mask_bound`: the request asked for sampling masks with this top-k bound, so the reply must carry
    them, one valid row per output token (sampling_masks.py); None: whatever mask keys the body has are ignored."""
    result = None
    if vocab_size <= _INT32_IDS:
        try:
            response = _fast_decoder(vocab_size).decode(body)
        except msgspec.DecodeError:  # any schema, constraint or JSON failure: the strict path names it
            pass
        else:
            result = _accept(response, vocab_size, sampling_mask_bound)
    return result if result is not None else _decode_strictly(body, vocab_size, sampling_mask_bound)


def _accept(response: _FastResponse[Any], vocab_size: int, mask_bound: int | None = None) -> GenerateResult | None:
    """The fast path's verdict on a body that fits the constrained schema: the result, or None for the strict path
    to decide (the cross-field rules below, checked in the same terms)."""
    meta = response.meta_info
    entries = meta.output_token_logprobs
    n = meta.completion_tokens
    finish = meta.finish_reason
    if (meta.prompt_tokens is None and not isinstance(finish, _Abort)) or len(entries) != n or (
            isinstance(finish, _Stop) and finish.matched == NAN_MATCHED):
        return None
    logprob_of, token_id_of = _PLAIN_COLUMNS
    token_ids = list(map(token_id_of, entries))
    if _ENCODE(token_ids) != bytes(response.output_ids) and token_ids != _output_ids(response.output_ids):
        return None
    # Values the schema bounded: float32 holds every logprob (rounded as the strict path's astype rounds), int32
    # every id.
    logprobs = np.fromiter(map(logprob_of, entries), dtype=np.float32, count=n)
    return _result(response, np.fromiter(token_ids, dtype=np.int32, count=n), logprobs, vocab_size, mask_bound)


def _output_ids(raw: msgspec.Raw) -> list[int] | None:
    """`output_ids` written otherwise than compactly (whitespace, `-0`): decoded as the strict path decodes it."""
    try:
        return _OUTPUT_IDS.decode(raw)
    except msgspec.DecodeError:
        return None


def _decode_strictly(body: bytes, vocab_size: int, mask_bound: int | None = None) -> GenerateResult:
    """The strict path: every rule of docs/design.md 5.3 in order, the first broken one raised with its name."""
    response = _decode(body)
    meta = response.meta_info
    entries = meta.output_token_logprobs
    n = meta.completion_tokens
    finish = meta.finish_reason
    if meta.prompt_tokens is None and not isinstance(finish, _Abort):
        raise UpstreamError("engine response breaks the schema: Object missing required field `prompt_tokens` - at "
                            "`$.meta_info`", rule="meta_info")
    if isinstance(finish, _Stop) and finish.matched == NAN_MATCHED:
        # SGLang replaced a NaN-sampled token and finished (schedule_batch.py): not the policy's tokens.
        raise UpstreamError("engine finished with 'NaN happened': the sampler produced NaN probabilities",
                            rule="nan_happened")
    if len(entries) != n or len(response.output_ids) != n:
        raise UpstreamError(
            f"engine response lengths disagree: completion_tokens={n}, output_ids={len(response.output_ids)}, "
            f"output_token_logprobs={len(entries)}",
            rule="length_mismatch",
        )
    logprob_of, token_id_of = _PLAIN_COLUMNS if not entries or isinstance(entries[0], tuple) else _ENTRY_COLUMNS
    token_ids = list(map(token_id_of, entries))
    wide = np.fromiter(map(logprob_of, entries), dtype=np.float64, count=n)
    fits = np.abs(wide) <= _FLOAT32_MAX  # False for NaN, infinities and values float32 cannot hold
    if not fits.all():
        i = int(np.flatnonzero(~fits)[0])
        raise UpstreamError(f"output_token_logprobs[{i}] has a non-finite logprob", rule="logprob_value")
    logprobs = wide.astype(np.float32)
    try:
        ids = np.fromiter(token_ids, dtype=np.int64, count=n)
    except OverflowError:  # an id beyond int64: refused just below, like every other out-of-range id
        ids = np.array(token_ids, dtype=object)
    if n and (ids.min() < 0 or ids.max() >= vocab_size):
        i = next(i for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise UpstreamError(
            f"output_token_logprobs[{i}] token id {token_ids[i]} is outside [0, {vocab_size})", rule="token_range"
        )
    if token_ids != response.output_ids:
        i = next(i for i, (a, b) in enumerate(zip(token_ids, response.output_ids, strict=True)) if a != b)
        raise UpstreamError(
            f"output_token_logprobs[{i}] token id {token_ids[i]} != output_ids[{i}] {response.output_ids[i]}",
            rule="token_mismatch",
        )
    return _result(response, ids.astype(np.int32), logprobs, vocab_size, mask_bound)


def _result(response: _GenerateResponse[Any] | _FastResponse[Any], ids: np.ndarray, logprobs: np.ndarray,
            vocab_size: int, mask_bound: int | None) -> GenerateResult:
    """The result of a body whose tokens passed: the rest of meta_info (weight spans, top logprobs, sampling masks)
    checked here."""
    meta = response.meta_info
    n = meta.completion_tokens
    spans = None if meta.weight_versions is None else _weight_spans(meta.weight_versions, n)
    raw_experts = bytes(meta.routed_experts)
    top = None if meta.output_top_logprobs is None else _top_logprobs(meta.output_top_logprobs, n, vocab_size)
    masks = None
    if mask_bound is not None:
        masks = SamplingMasks.from_engine(meta.output_token_sampling_mask, meta.output_token_sampling_logprobs, ids,
                                          vocab_size, mask_bound)
    return GenerateResult(
        text=response.text,
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=_finish_reason(meta.finish_reason),
        prompt_tokens=meta.prompt_tokens or 0,
        completion_tokens=n,
        cached_tokens=meta.cached_tokens,
        weight_version=None if meta.weight_version is None else str(meta.weight_version),
        e2e_latency=meta.e2e_latency,
        rid=meta.id,
        routed_experts=raw_experts if raw_experts and raw_experts != b"null" else None,
        top_logprobs=top,
        weight_versions=spans,
        sampling_masks=masks,
    )


def _weight_spans(spans: list[_WeightSpan], n: int) -> tuple[tuple[str, int, int], ...]:
    """Spans must tile [0, n) in order (an empty request has one span [0, 0))."""
    at = 0
    for i, span in enumerate(spans):
        if span.start != at or span.end < span.start or span.end > n or (span.end == span.start and n):
            raise UpstreamError(f"meta_info.weight_versions[{i}] {span.version!r} [{span.start}, {span.end}) does "
                                f"not continue the spans at {at} within {n} output tokens", rule="weight_versions")
        at = span.end
    if at != n or not spans:
        raise UpstreamError(f"meta_info.weight_versions cover {at} of {n} output tokens", rule="weight_versions")
    return tuple((s.version, s.start, s.end) for s in spans)


def _top_logprobs(rows: list[list[_LogprobEntry] | None], n: int, vocab_size: int) -> list[list[tuple[float, int]]]:
    """The top-k alternatives per output token, held to the same rules as the sampled tokens' entries."""
    if len(rows) != n:
        raise UpstreamError(f"output_top_logprobs has {len(rows)} rows for {n} output tokens", rule="length_mismatch")
    out: list[list[tuple[float, int]]] = []
    for i, row in enumerate(rows):
        entries: list[tuple[float, int]] = []
        for entry in row or ():
            if not math.isfinite(entry.logprob):
                raise UpstreamError(f"output_top_logprobs[{i}] has a non-finite logprob", rule="logprob_value")
            if not 0 <= entry.token_id < vocab_size:
                raise UpstreamError(f"output_top_logprobs[{i}] token id {entry.token_id} is outside "
                                    f"[0, {vocab_size})", rule="token_range")
            entries.append((float(entry.logprob), int(entry.token_id)))
        out.append(entries)
    return out
