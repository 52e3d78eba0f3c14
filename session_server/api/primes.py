"""POST /sessions/{id}/prime: a session's first prompt rendered and tokenized before its first turn (issue 39).

A GRPO group starts as one session: the trainer primes it with the group's first request (a Chat Completions body:
`messages`, `tools`, `chat_template_kwargs`; sampling fields are read and ignored) and forks it at the prompt into G
children (POST /sessions/{id}/fork with the session still turnless). The render and tokenization run once, here;
every child's first turn that sends the same messages, tools and template kwargs takes the primed ids as its prompt
(LinearTrajectory.prime) and recognises the repeated messages by their bytes (SentHistory), so it costs what an
appended turn of its body costs. A first turn that sends anything else renders as usual: priming never changes the
ids a turn sends. Answers `{"prompt_tokens": N, "prefill": {"prompt_tokens", "cached_tokens"} | null}`; 409 while
a turn is in flight, 400 once the session has a turn.

With --fork-prefill engine (the default) the engine prefills the prompt before the prime answers (turns/prefill.py),
so that the G first turns, arriving together in any order, find it in the radix cache; `prefill` is what the engine
reported, null when it was not asked (off, paused) or did not answer.

With --journal the prime request is on disk before the prime answers (sessions/journal.py `primes`, under a key the
session and later its children name): a restart renders it again, so the session and its children come back primed.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from session_server.chat.serving import CHAT
from session_server.engine.wire import encode_ids
from session_server.errors import SessionBusyError, json_response
from session_server.sessions.journal import SessionInfo
from session_server.sessions.session import Session
from session_server.state import ServerState, server_of
from session_server.turns.pipeline import read_body
from session_server.turns.prefill import prefill_json, prefill_primed
from trajectory import LinearTrajectory
from trajectory.errors import ForkPointError
from trajectory.images import ImageLimits
from trajectory.linear import PrimedPrompt


def render_prime(body: bytes, trajectory: LinearTrajectory, images: ImageLimits) -> tuple[PrimedPrompt, str | None]:
    """The primed prompt of a Chat Completions body, and the body's `model` (which may name a LoRA adapter)."""
    turn = CHAT.parse(body, trajectory, images)
    primed = trajectory.prime(turn.messages, turn.tools, turn.template_kwargs, turn.messages_json)
    # its ids encoded for the engine once, for the prefill and every child's first turn
    return dataclasses.replace(primed, plan=dataclasses.replace(primed.plan, wire_ids=encode_ids(
        primed.plan.prompt_ids))), turn.model


def _primable(session: Session) -> LinearTrajectory:
    if session.claims:
        raise SessionBusyError(f"session {session.id} has a chat in flight: prime a session before its first turn")
    if len(session.segments) > 1 or session.trajectory.checkpoints:
        raise ForkPointError(f"session {session.id} has turns: a session is primed before its first turn")
    return session.trajectory


def prime_key(session_id: str) -> str:
    """The journal's key of a primed prompt (sessions/journal.py `primes`): new per prime, so the children of an
    earlier prime of the same session keep theirs."""
    return f"{session_id}/{secrets.token_hex(4)}"


async def journal_prime(server: ServerState, session: Session, body: bytes) -> None:
    """With --journal, the prime request on disk under a new key that the session then names, before the prime is
    answered (a restart renders it again, sessions/recovery.py); without, nothing."""
    if server.journal is None:
        return
    key = prime_key(session.id)
    await server.journal.primed(dataclasses.replace(SessionInfo.of(session), primed=key), key, body)
    session.primed = key


def primer(server: ServerState) -> Callable[[bytes], PrimedPrompt]:
    """A journaled prime request rendered again at a restart (sessions/recovery.py): the same ids, a fresh plan."""
    return lambda body: render_prime(body, server.new_trajectory(), server.config.image_limits)[0]


def _unchanged(server: ServerState, session: Session, trajectory: LinearTrajectory) -> None:
    """After an await: the session is still there (404) and still the turnless one being primed (409)."""
    if _primable(server.registry.require(session.id)) is not trajectory:
        raise SessionBusyError(f"session {session.id} changed while its prompt was primed")


async def prime_session(request: Request) -> Response:
    server = server_of(request)
    config = server.config
    session = server.registry.require(request.path_params["session_id"])
    body = await read_body(request, config.max_request_bytes, config.body_timeout)
    trajectory = _primable(session)
    primed, model = await server.pool.run(render_prime, body, trajectory, config.image_limits)
    _unchanged(server, session, trajectory)
    await journal_prime(server, session, body)
    _unchanged(server, session, trajectory)
    trajectory.set_primed(primed)
    done = await prefill_primed(server, session.id, primed, session.metadata, model)
    return json_response({"prompt_tokens": primed.num_tokens, "prefill": prefill_json(done)})
