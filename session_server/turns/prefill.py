"""What a fork's children share, prefilled by the engine once before their turns (issue 39; api/primes.py, forks.py).

Why: a GRPO group's G first turns send the same prompt at once. Each is answered from SGLang's radix cache only if
the prompt's KV is there when it is scheduled; G turns that arrive together are scheduled before any of them has
inserted it, and each prefills the whole prompt (measured on the sim's books: 4,115 or 8,222 prefilled tokens per
group of 8 from run to run). So the prime itself asks the engine for the prompt with `max_new_tokens: 0`: SGLang
0.5.23 runs that as a prefill-only request (`Req.is_prefill_only`: no token is sampled) and, as any finished request,
releases its KV into the radix cache (`release_kv_cache(..., checkpoint=True)`, mem_cache/common.py). The prime
answers after the engine did, so every child's first turn finds the prompt cached whatever the order the turns
arrive in, and prefills its last token only (SGLang always computes a prompt's last token).

The request is the one a child's first turn sends but for its sampling: the same ids (images included), the same
`extra_key` (the weights' cache key, engine/versions.py, and the adapter the session would take, engine/adapters.py),
on the worker the children are placed on (the parent's: Lifecycle.fork). It is an optimisation, never a condition:
a prime while the server is paused (a weight update), or whose engine call fails or times out, answers without it
(`prefill: null`) and the children prefill the prompt on their first turns, as without priming.

The same holds for a fork in mid-episode under --engine-sessions: SGLang 0.5.23's streaming session keeps its turns'
KV in its own slot and publishes to the radix cache only the prompt of its first turn (session/streaming_session.py
`try_checkpoint`: "A turn publishes nothing of its own, except the first prompt"; `release_session` frees the slot
without inserting it), and it cannot be branched (docs/engines.md). So the children, who each open their own engine
session, would each prefill the parent's history past that prompt; the fork has the engine prefill the forked prefix
once instead (api/forks.py), a plain request whose KV the tree keeps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from session_server.engine.adapters import AdapterRef, adapter_cache_key
from session_server.engine.drains import abandon
from session_server.engine.wire import GenerateRequest, encode_generate
from session_server.errors import EngineUnavailableError
from session_server.state import ServerState
from session_server.turns.turn import new_rid
from trajectory.images import Image
from trajectory.linear import PrimedPrompt

logger = logging.getLogger("session_server.turns.prefill")


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What the engine reported for the prime's prefill-only request."""

    prompt_tokens: int
    cached_tokens: int  # of the prompt, already in its radix cache (another group's prompt, a retry)


def prefill_json(done: Prefilled | None) -> dict[str, int] | None:
    """A reply's `prefill`: what the engine reported, or null when it was not asked or did not answer."""
    return None if done is None else {"prompt_tokens": done.prompt_tokens, "cached_tokens": done.cached_tokens}


class _Meta(msgspec.Struct):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: Any = None


class _Reply(msgspec.Struct):
    meta_info: _Meta


_decode = msgspec.json.Decoder(_Reply).decode


def _adapter(server: ServerState, metadata: dict[str, Any], model: str | None) -> AdapterRef | None:
    """The adapter revision a child's first turn would take now (the session's wish, if the engines hold it)."""
    book = server.adapters
    if book is None:
        return None
    name = book.wanted(metadata, model)
    revision = book.current.get(name) if name is not None else None
    return AdapterRef(name, revision) if name is not None and revision is not None else None


async def prefill(server: ServerState, session_id: str, prompt_ids: np.ndarray, images: Sequence[Image],
                  metadata: dict[str, Any], model: str | None, wire_ids: bytes | None = None) -> Prefilled | None:
    """Send `prompt_ids` (with their `images`) to the session's worker as a prefill-only request and wait for it;
    None when not sent (off, paused) or not done (refused, failed, timed out)."""
    config = server.config
    if config.fork_prefill == "off" or server.lifecycle.paused or server.lifecycle.shutting_down:
        return None
    vision = server.family.vision
    engine = server.engine
    engine.place(session_id)
    version = engine.version_of(session_id)
    adapter = _adapter(server, metadata, model)
    request = GenerateRequest(
        input_ids=prompt_ids, sampling_params={"max_new_tokens": 0}, rid=new_rid(),
        images=images, image_pad=vision.tokens.pad if vision is not None else -1,
        extra_key=adapter_cache_key(engine.cache_key_of(session_id, version), adapter),
        lora_path=adapter.engine_name if adapter is not None else None, input_json=wire_ids,
    )
    payload = await server.pool.run_sized(request.size, encode_generate, request)
    work = asyncio.ensure_future(engine.generate(payload, session_id))
    try:
        finished, _ = await asyncio.wait((work,), timeout=config.request_timeout)
    except asyncio.CancelledError:  # the caller went away: aborted by its rid, as any engine request
        abandon(server.drains, session_id, request.rid, work)
        raise
    try:
        if not finished:
            abandon(server.drains, session_id, request.rid, work)
            raise TimeoutError(f"no answer within --request-timeout {config.request_timeout:g}s")
        reply = work.result()
    except (TimeoutError, EngineUnavailableError) as exc:
        server.metrics.fork_prefills.labels("failed").inc()
        logger.warning("session %s: the prefill of what its fork shares did not finish (%r)", session_id, exc)
        return None
    if not reply.ok:
        server.metrics.fork_prefills.labels("refused").inc()
        logger.warning("session %s: the engine refused the prefill of what its fork shares (%d %r)", session_id,
                       reply.status, reply.body[:200])
        return None
    try:
        meta = _decode(reply.body).meta_info
    except msgspec.DecodeError as exc:  # not an answer to report: no figures are made up for it
        server.metrics.fork_prefills.labels("failed").inc()
        logger.warning("session %s: the engine's answer to the prefill is not SGLang's (%s)", session_id, exc)
        return None
    finish = meta.finish_reason
    if isinstance(finish, dict) and finish.get("type") == "abort":  # aborted for everyone (a weight update)
        server.metrics.fork_prefills.labels("failed").inc()
        return None
    server.metrics.fork_prefills.labels("done").inc()
    return Prefilled(prompt_tokens=meta.prompt_tokens, cached_tokens=meta.cached_tokens)


async def prefill_primed(server: ServerState, session_id: str, primed: PrimedPrompt, metadata: dict[str, Any],
                         model: str | None) -> Prefilled | None:
    """A primed prompt's prefill (api/primes.py, POST /sessions with `prime`)."""
    plan = primed.plan
    return await prefill(server, session_id, plan.prompt_ids, plan.images, metadata, model, plan.wire_ids)
