"""A reply that the engine aborted and that went on in a second request, as one reply.

Why: SGLang aborts every in-flight request when the trainer updates weights (`/update_weight_version`,
`/update_weights_from_*` with `abort_all_requests`, `/pause_generation` mode `abort`). Failing such a turn loses
everything it sampled; instead the server sends prompt + the tokens already sampled as the next request's prompt,
with the token budget reduced by what was sampled, and the engine samples the rest. For training the turn must look
as if it had been sampled in one go: prompt + every sampled token, each token's logprob as the engine reported it
when it sampled it, and which weights sampled it. `join_results` builds exactly that from the pieces.

Which aborts qualify (`continuable_abort`), read from SGLang 0.5.23: a weight update, a pause in mode abort and a
trainer's `/abort_request {"abort_all": true}` all dispatch `AbortReq(abort_all=True)` without a message
(tokenizer_manager.py `abort_request`), so a running request ends with `FINISH_ABORT()` -- message "Aborted",
`status_code` null -- and a queued one with "Abort in waiting queue" (`_handle_abort_req`). Aborts with a reason of
their own carry a status code (the scheduler's request-timeout abort is a 503 with an SLA message, a refused input
a 400) and are not continued. The abort of a single rid also reads "Aborted"; the only party that knows our rids is
the server itself, and a turn it aborts never reads its engine reply, so a turn that reads one was aborted by the
engine for everyone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .engine_output import GenerateResult
from .sampling_masks import SamplingMasks

# Ours, never the engine's: a reply cut where its tokens stop being of the weights its request was keyed for
# (`cut_to_version`); continued like an abort of everything.
WEIGHTS_CHANGED = "Weights changed under the request"
CONTINUABLE_ABORT_MESSAGES = ("Aborted", "Abort in waiting queue", WEIGHTS_CHANGED)


def continuable_abort(finish_reason: dict[str, Any]) -> bool:
    """An abort of every in-flight request by the engine (see the module docstring), not one with its own reason."""
    return (finish_reason.get("type") == "abort" and finish_reason.get("status_code") is None
            and finish_reason.get("message") in CONTINUABLE_ABORT_MESSAGES)


def _spans(result: GenerateResult) -> tuple[tuple[str, int, int], ...]:
    n = len(result.output_ids)
    if result.weight_versions is not None:
        return result.weight_versions
    return ((str(result.weight_version), 0, n),) if n else ()


def _joined_spans(before: GenerateResult, after: GenerateResult) -> tuple[tuple[str, int, int], ...] | None:
    """Spans over both pieces, the second shifted past the first; adjacent spans of one version merged."""
    if before.weight_versions is None and after.weight_versions is None and (
            not len(before.output_ids) or before.weight_version == after.weight_version):
        return None  # one version throughout: the record's weight_version says it all
    shift = len(before.output_ids)
    spans: list[tuple[str, int, int]] = []
    for version, start, end in (*_spans(before), *((v, s + shift, e + shift) for v, s, e in _spans(after))):
        if spans and spans[-1][0] == version and spans[-1][2] == start:
            spans[-1] = (version, spans[-1][1], end)
        else:
            spans.append((version, start, end))
    return tuple(spans) or None


def join_results(before: GenerateResult, after: GenerateResult) -> GenerateResult:
    """`before` (an aborted reply, itself possibly joined) continued by `after`, the reply to prompt + before's
    tokens: one result over the original prompt.

    Tokens, logprobs, top logprobs, sampling masks and text are concatenated; the finish reason is the last
    request's (a `length` counts the whole reply's tokens); `prompt_tokens` is the original prompt's;
    `cached_tokens` the first prefill's (the continuation's, within the original prompt, when the first never ran);
    the weight versions span both pieces. `rid` stays the first request's: the turn is known by it (Responses
    `previous_response_id`). The routed experts are the last request's: sent with the same
    `routed_experts_start_len`, they cover the original prompt and every sampled token, under the weights that
    finished the reply.
    """
    n = len(before.output_ids)
    finish = after.finish_reason
    if finish.get("type") == "length" and isinstance(finish.get("length"), int):
        finish = {**finish, "length": finish["length"] + n}
    prompt_tokens = after.prompt_tokens - n if after.prompt_tokens else before.prompt_tokens
    cached = before.cached_tokens if before.prompt_tokens else min(after.cached_tokens, prompt_tokens)
    top = None
    if after.top_logprobs is not None and (before.top_logprobs is not None or not n):
        top = [*(before.top_logprobs or ()), *after.top_logprobs]
    masks = None
    if after.sampling_masks is not None and (before.sampling_masks is not None or not n):
        masks = SamplingMasks.concat([m for m in (before.sampling_masks, after.sampling_masks) if m is not None])
    latency = None if after.e2e_latency is None else after.e2e_latency + (before.e2e_latency or 0.0)
    return dataclasses.replace(
        after,
        text=before.text + after.text,
        output_ids=np.concatenate([before.output_ids, after.output_ids]).astype(np.int32, copy=False),
        logprobs=np.concatenate([before.logprobs, after.logprobs]).astype(np.float32, copy=False),
        finish_reason=finish,
        prompt_tokens=max(prompt_tokens, 0),
        completion_tokens=n + after.completion_tokens,
        cached_tokens=cached,
        e2e_latency=latency,
        rid=before.rid if before.rid is not None else after.rid,
        top_logprobs=top,
        weight_versions=_joined_spans(before, after),
        sampling_masks=masks,
    )


def sampled_by(result: GenerateResult, version: str) -> int:
    """How many leading tokens of `result` the weights `version` sampled."""
    n = 0
    for span_version, start, end in _spans(result):
        if span_version != version or start != n:
            break
        n = end
    return n


def cut_to_version(result: GenerateResult, version: str, decode: Callable[[np.ndarray], str]
                   ) -> GenerateResult | None:
    """None when weights `version` sampled every token of `result` (the version its request's cache key named);
    else `result` cut to its leading tokens of that version, as an abort (WEIGHTS_CHANGED) to continue from.

    Why: a token sampled after the engine's weights changed under the request was sampled on KV the old weights
    computed (SGLang keeps a running request's KV across an update in place) or on a prefix cached under the old key,
    so no single checkpoint gives its logprob. The tokens before the change are exact and are kept; the rest is
    sampled again under the new version's key. `decode` gives the kept tokens' text. The cut keeps the reply's
    `weight_version`: the weights the engine serves now.
    """
    if result.weight_versions is None and result.weight_version is None:
        return None  # an engine that names no weights: nothing to check against
    if continuable_abort(result.finish_reason):
        # An abort of everything (an update with abort_all_requests): SGLang loads new weights only once the request
        # has ended, so a token it labels with the new version at the boundary was sampled by the old ones.
        return None
    kept = sampled_by(result, version)
    n = len(result.output_ids)
    if kept == n:  # every token (or none: nothing was sampled) of the keyed weights
        return None
    ids = result.output_ids[:kept]
    return dataclasses.replace(
        result, text=decode(ids) if kept else "", output_ids=ids, logprobs=result.logprobs[:kept],
        finish_reason={"type": "abort", "message": WEIGHTS_CHANGED}, completion_tokens=kept,
        top_logprobs=result.top_logprobs[:kept] if result.top_logprobs is not None else None,
        weight_versions=((version, 0, kept),) if kept else None, routed_experts=None,
        sampling_masks=result.sampling_masks.rows(0, kept) if result.sampling_masks is not None else None)
