"""Session lifecycle routes: create, inspect, delete, and the read-only model list under a session URL.

Create and DELETE are thin: the session's lifecycle (create, abort the in-flight chat, close the engine session,
forget behind a tombstone) is owned by sessions/lifecycle.py, which the idle sweep and the shutdown use as well.

GET takes a snapshot of the trajectory on the loop (copies, no await) and builds the body -- token list, records, a
mismatch report that re-renders and diffs the whole history, the JSON encode; tens of ms at 32k tokens -- on the CPU
pool, so inspecting a long session does not stall /health or other sessions' chats.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from session_server.api.primes import journal_prime, prime_key, render_prime
from session_server.engine.client import EngineReply
from session_server.errors import (
    AbortReason,
    EngineUnavailableError,
    RequestTooLargeError,
    error_response,
    json_response,
)
from session_server.frontend.root_session import header_id, not_found
from session_server.http.body import decode_object, read_body
from session_server.sessions.session import Session
from session_server.state import ServerState, server_of
from session_server.turns.prefill import prefill_json, prefill_primed
from session_server.turns.sampling_masks import mask_policy
from trajectory import LinearTrajectory, Segment
from trajectory.errors import RequestValidationError
from trajectory.forks import parse_fork

_encoder = msgspec.json.Encoder()
METADATA_ENVELOPE = 1024  # bytes of the body around the metadata object (key, braces, whitespace)


def lookup(server: ServerState, session_id: str) -> Session:
    return server.registry.require(session_id)


def relay(reply: EngineReply) -> Response:
    """The engine's answer to a read-only call (the model list), passed to the client as it came: status, body and
    content type."""
    return Response(reply.body, status_code=reply.status, media_type=reply.content_type)


class _Prime(msgspec.Struct):
    """POST /sessions' `prime` as the bytes it came as: its messages' bytes are what the children's first turns are
    recognised by (SentHistory)."""

    prime: msgspec.Raw = msgspec.Raw()


_decode_prime = msgspec.json.Decoder(_Prime).decode


def _create_body(body: bytes) -> tuple[dict[str, Any], bytes | None]:
    """The body as an object, checked as any body is (the prime is left to the chat parse), and the prime's bytes."""
    obj = decode_object(body, {}, unchecked="prime")
    if obj.get("prime") is None:
        return obj, None
    return obj, bytes(_decode_prime(body).prime)


async def create_session(request: Request) -> Response:
    """POST /sessions, optional body `{"metadata": {...}, "return_sampling_masks": bool, "prime": {...}, "n": N}`. The
    metadata is bounded by its encoded size, and a body without `prime` by the metadata cap (plus room for the
    envelope) as well as the request limit. `return_sampling_masks` overrides --return-sampling-masks for this
    session (turns/sampling_masks.py).

    `prime` (a Chat Completions request: `messages`, `tools`, `chat_template_kwargs`) primes the new session with its
    first prompt as POST /sessions/{id}/prime does (rendered once, prefilled by the engine, journaled), in the same
    request: `{"session_id", "prompt_tokens", "prefill"}`. With `n` as well, a GRPO group in one request: `n` sessions
    that each start at that primed prompt, as a fork at the prompt of a primed session that is then deleted, without
    the open, fork and delete requests (`{"session_ids", "group", "root_session", "fork_position", "fork_turns",
    "prompt_tokens", "prefill"}`; the root is never a session of its own). `n` without `prime` is a 400; past
    --max-fork a 400, past --max-sessions a 429 with nothing created, as a fork."""
    server = server_of(request)
    config = server.config
    raw = await read_body(request, config.max_request_bytes, config.body_timeout)
    obj, prime = _create_body(raw)
    small = min(config.max_request_bytes, config.max_metadata_bytes + METADATA_ENVELOPE)
    if prime is None and len(raw) > small:
        raise RequestTooLargeError(f"request body exceeds the limit of {small} bytes")
    metadata = obj.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise RequestValidationError("'metadata' must be an object")
    size = len(_encoder.encode(metadata))
    if size > config.max_metadata_bytes:
        raise RequestTooLargeError(
            f"'metadata' is {size} bytes encoded; the limit is {config.max_metadata_bytes} bytes"
        )
    masks = obj.get("return_sampling_masks")
    if masks is not None and not isinstance(masks, bool):
        raise RequestValidationError("'return_sampling_masks' must be a boolean")
    if obj.get("n") is not None:
        if prime is None:
            raise RequestValidationError("'n' makes a group of sessions that share a primed prompt: give 'prime'")
        return await _create_group(server, prime, parse_fork(obj["n"], None, config.max_fork)[0], metadata, masks)
    if prime is None:
        # 503 if not journaled
        session = await server.lifecycle.create_durably(server.new_segments(), metadata, masks)
        return json_response({"session_id": session.id})
    server.lifecycle.check_accepting()
    segments = server.new_segments()
    primed, model = await server.pool.run(render_prime, prime, segments.main, config.image_limits)
    session = server.lifecycle.create(segments, metadata)
    session.sampling_masks = masks
    try:  # the session's row and its primed prompt in one transaction, or neither
        await journal_prime(server, session, prime)
    except BaseException:
        server.registry.discard(session.id)
        raise
    segments.main.set_primed(primed)  # no turn can have come: nobody knew its id
    done = await prefill_primed(server, session.id, primed, metadata, model)
    return json_response({"session_id": session.id, "prompt_tokens": primed.num_tokens,
                          "prefill": prefill_json(done)})


async def _create_group(server: ServerState, prime: bytes, n: int, metadata: dict[str, Any],
                        masks: bool | None) -> Response:
    """`n` sessions at one primed prompt (Lifecycle.create_group): render, prefill, fork, in one request."""
    server.lifecycle.check_accepting()
    root = server.new_segments()
    primed, model = await server.pool.run(render_prime, prime, root.main, server.config.image_limits)
    root.main.set_primed(primed)
    root_id = server.registry.mint()
    done = await prefill_primed(server, root_id, primed, metadata, model)
    key = prime_key(root_id)
    children = await server.lifecycle.create_group(root_id, root, n, metadata, masks, server.new_segments,
                                                   (key, prime) if server.journal is not None else None)
    lineage = children[0].lineage
    assert lineage is not None
    return json_response({"session_ids": [c.id for c in children], "group": lineage.group, "root_session": root_id,
                          "fork_position": lineage.position, "fork_turns": lineage.turns,
                          "prompt_tokens": primed.num_tokens, "prefill": prefill_json(done)})


async def get_session(request: Request) -> Response:
    server = server_of(request)
    session = lookup(server, request.path_params["session_id"])
    async with session.lock:  # a consistent snapshot: a memcpy of the tokens, no await inside
        snapshot = session.segments.snapshot()
        busy = set(session.busy_segments())
        live = {
            "nbytes": session.segments.nbytes,  # the live footprint (the snapshot has no growth slack)
            "session_id": session.id,
            "metadata": session.metadata,
            "created_at": session.created_at,
            "lineage": None if session.lineage is None else session.lineage.info(),
            "busy": bool(session.claims),
            "return_sampling_masks": mask_policy(server.config, session) is not None,
        }
    body = await server.pool.run(_session_body, snapshot, busy, live)
    return Response(body, media_type="application/json")


def _session_body(snapshot: list[tuple[Segment, LinearTrajectory]], busy: set[int], live: dict[str, Any]) -> bytes:
    """Pool side of GET: records, token list, mismatch report (a re-render + diff) and the JSON encode.

    The top level is the session's first segment, as a single-line session always showed it; `segments` lists every
    segment (where it came from, its size, whether a turn runs on it) and the others' trajectories in full."""
    (_, main), *others = snapshot
    info = main.to_dict()
    info["mismatch_report"] = main.mismatch_report()
    info.update(live)
    info["segments"] = [
        {**segment.info(), "num_tokens": traj.num_tokens, "num_turns": len(traj.records), "busy": segment.id in busy,
         "rollbacks_by_reason": dict(traj.rollbacks)}
        for segment, traj in snapshot
    ]
    info["segment_trajectories"] = {str(segment.id): traj.to_dict() for segment, traj in others}
    return _encoder.encode(info)


async def delete_session(request: Request) -> Response:
    server = server_of(request)
    session = lookup(server, request.path_params["session_id"])
    await server.lifecycle.close(session, AbortReason.DELETE)
    return Response(status_code=204)


async def list_models(request: Request) -> Response:
    """GET /sessions/{id}/v1/models: the engine's OpenAI model list, passed through as is (read-only)."""
    server = server_of(request)
    lookup(server, request.path_params["session_id"])
    reply = await server.engine.models()
    return relay(reply)


async def list_models_at_root(request: Request) -> Response:
    """GET /v1/models: the engine's model list. A harness asks before any episode exists, so the X-Session-ID header
    is optional here; when given it must name a live session (nothing is created by a read)."""
    server = server_of(request)
    sid = header_id(request)
    if sid is not None:
        if not server.registry.knows(sid):
            raise not_found(server, sid)
        server.registry.require(sid)
    reply = await server.engine.models()
    return relay(reply)


async def retrieve_model(request: Request) -> Response:
    """GET /sessions/{id}/v1/models/{model_id}: one entry of the engine's model list, or OpenAI's 404.

    Looked up in the list rather than forwarded: the id comes from the client, and a forwarded path could be made
    to reach other engine routes (`../abort_request`); only the read-only list is ever asked of the engine.
    """
    server = server_of(request)
    model_id = request.path_params["model_id"]
    lookup(server, request.path_params["session_id"])
    reply = await server.engine.models()
    if not reply.ok:
        return relay(reply)
    try:
        listing = msgspec.json.decode(reply.body)
        data = listing["data"]
        found = next((m for m in data if isinstance(m, dict) and m.get("id") == model_id), None)
    except (msgspec.DecodeError, KeyError, TypeError) as exc:
        return error_response(EngineUnavailableError(f"engine model list is malformed: {exc}"))
    if found is None:
        body = {"error": {"message": f"The model '{model_id}' does not exist", "type": "invalid_request_error",
                          "param": "model", "code": "model_not_found"}}
        return Response(_encoder.encode(body), status_code=404, media_type="application/json")
    return Response(_encoder.encode(found), media_type="application/json")
