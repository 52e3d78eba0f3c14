"""POST /sessions/{id}/fork: N sessions that each start with the session's history (trajectory/forks.py).

Body `{"n": N, "metadata": {...}, "at": K}`: N children (1..--max-fork) of the session's current segment, holding
its first K turns (`at` absent or "end": all of them); each child's metadata is the parent's updated with
`metadata`. Answers `{"session_ids": [...], "group", "fork_position", "fork_turns", "prefill"}`. All or nothing: 404
for an unknown or deleted session, 409 while a turn of it is in flight, 400 for N or K out of range (N above
--max-fork or --max-sessions), 429 + Retry-After when N children do not fit under --max-sessions now
(errors.ForkCapacityError: not POST /sessions' 503, which a proxy may retry on another replica), 503 while paused or
if the journal cannot write the children. A session primed and still turnless (api/primes.py) forks at its prompt
(`at` 0 or absent): the GRPO group's fork, whose children share the rendered prompt and whose fork position is its
length.

Behind nginx with replicas, the children stay on the parent's replica: their ids are minted by it and carry its
name (`r1.<hex>`, sessions/registry.py), which is what routes an id (deploy/nginx.py), so a child's turns reach the
replica that holds its history. The children are placed on the parent's engine worker (EnginePlacement.place_beside),
whose radix cache holds the prefix they share. With --engine-sessions a child opens its own engine session (SGLang's
streaming sessions cannot be branched: docs/engines.md); the parent's engine session holds its history outside the
radix cache, so a fork of such a parent has the engine prefill the forked prefix once before it answers (`prefill`,
turns/prefill.py; --fork-prefill off: each child prefills it), and the children's turns find it there.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from session_server.errors import RequestTooLargeError, json_response
from session_server.http.body import read_object
from session_server.state import server_of
from session_server.turns.prefill import prefill, prefill_json
from trajectory.errors import RequestValidationError
from trajectory.forks import parse_fork

_encoder = msgspec.json.Encoder()
_ENVELOPE = 1024  # bytes of the body around the metadata object (n, at, keys, braces)


async def fork_session(request: Request) -> Response:
    server = server_of(request)
    config = server.config
    parent = server.registry.require(request.path_params["session_id"])  # 404 before the body is read
    obj = await read_object(request, min(config.max_request_bytes, config.max_metadata_bytes + _ENVELOPE),
                            config.body_timeout)
    n, at = parse_fork(obj.get("n", 1), obj.get("at"), config.max_fork)
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise RequestValidationError("'metadata' must be an object")
    if len(_encoder.encode(metadata)) > config.max_metadata_bytes:
        raise RequestTooLargeError(f"'metadata' is larger than {config.max_metadata_bytes} bytes encoded")
    parent = server.registry.require(parent.id)  # deleted while the body arrived: still a 404
    children = await server.lifecycle.fork(parent, n, at, metadata, server.new_segments)
    lineage = children[0].lineage
    assert lineage is not None
    done = None
    if lineage.turns and server.engine_sessions is not None and server.engine_sessions.state(parent.id) is not None:
        # The parent's engine session holds its history outside the radix cache: put the forked prefix there once.
        shared = children[0].segments.main
        done = await prefill(server, parent.id, shared.token_ids[:lineage.position], tuple(shared.images.values()),
                             parent.metadata, None)
    return json_response({"session_ids": [c.id for c in children], "group": lineage.group,
                          "fork_position": lineage.position, "fork_turns": lineage.turns,
                          "prefill": prefill_json(done)})
