"""POST /sessions/{id}/prime: a session's first prompt rendered and tokenized before its first turn (issue 39).

A GRPO group starts as one session: the trainer primes it with the group's first request (a Chat Completions body:
`messages`, `tools`, `chat_template_kwargs`; sampling fields are read and ignored) and forks it at the prompt into G
children (POST /sessions/{id}/fork with the session still turnless). The render and tokenization run once, here;
every child's first turn that sends the same messages, tools and template kwargs takes the primed ids as its prompt
(LinearTrajectory.prime) and recognises the repeated messages by their bytes (SentHistory), so it costs what an
appended turn of its body costs. A first turn that sends anything else renders as usual: priming never changes the
ids a turn sends. Answers `{"prompt_tokens": N}`; 409 while a turn is in flight, 400 once the session has a turn.
The primed prompt is not journaled: after a restart the first turn renders it again (the same ids).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from session_server.chat.serving import CHAT
from session_server.errors import SessionBusyError, json_response
from session_server.sessions.session import Session
from session_server.state import server_of
from session_server.turns.pipeline import read_body
from trajectory import LinearTrajectory
from trajectory.errors import ForkPointError
from trajectory.images import ImageLimits
from trajectory.linear import PrimedPrompt


def _prime(body: bytes, trajectory: LinearTrajectory, images: ImageLimits) -> PrimedPrompt:
    turn = CHAT.parse(body, trajectory, images)
    return trajectory.prime(turn.messages, turn.tools, turn.template_kwargs, turn.messages_json)


def _primable(session: Session) -> LinearTrajectory:
    if session.claims:
        raise SessionBusyError(f"session {session.id} has a chat in flight: prime a session before its first turn")
    if len(session.segments) > 1 or session.trajectory.checkpoints:
        raise ForkPointError(f"session {session.id} has turns: a session is primed before its first turn")
    return session.trajectory


async def prime_session(request: Request) -> Response:
    server = server_of(request)
    config = server.config
    session = server.registry.require(request.path_params["session_id"])
    body = await read_body(request, config.max_request_bytes, config.body_timeout)
    trajectory = _primable(session)
    primed = await server.pool.run(_prime, body, trajectory, config.image_limits)
    session = server.registry.require(session.id)  # deleted meanwhile: a 404
    if _primable(session) is not trajectory:
        raise SessionBusyError(f"session {session.id} changed while its prompt was primed")
    trajectory.set_primed(primed)
    return json_response({"prompt_tokens": primed.num_tokens})
