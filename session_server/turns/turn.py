"""What a turn is to the pipeline, whatever API carried it, and the two things every way a turn ends shares.

A front end (Chat Completions, Responses, Anthropic Messages) only translates: it parses its request into a
`TurnRequest` (the turn's messages and tools in the chat-template shape, the engine's sampling params) and formats
the turn's output -- a plain reply, a stream of events, its own error shape. Everything between -- the slot, the
body, TITO, limits, the engine call and its race, validation, the commit, the metrics -- is one pipeline
(pipeline.py for a plain reply, stream.py for a streamed one), so a fix there holds for every API.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from starlette.responses import Response

from session_server.engine.pacing import stream_interval
from session_server.engine.sessions import EngineSessions
from session_server.engine.wire import encode_generate
from session_server.errors import AbortReason, LimitExceededError
from session_server.metrics import Metrics
from session_server.sessions.session import Claim
from session_server.state import ServerState
from session_server.turns.commit import commit_turn
from session_server.turns.output import TurnOutput
from trajectory import LinearTrajectory, ModelFamily, SegmentPlan, TurnPlan, TurnRecord
from trajectory.errors import SessionError, UpstreamError

R = TypeVar("R")


@dataclass(slots=True)
class TurnRequest(Generic[R]):
    """A request as the pipeline sees it; `api` is the front end's own reading of it, for its reply."""

    messages: Any  # raw: validated and normalised once, by the trajectory's prepare (trajectory/messages.py)
    tools: list[dict[str, Any]] | None  # the tools the template renders for this turn
    sampling_params: dict[str, Any]
    api: R
    template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    model: str | None = None
    top_logprobs: int = 0  # top_logprobs_num on /generate
    parse_tool_calls: bool = True
    ignored: Sequence[str] = ()  # request fields accepted without effect on the tokens (counted by front end)
    messages_json: bytes | None = None  # the bytes `messages` were read from, if the front end kept them


# Request ids without a urandom read per turn: a 64-bit count from a random start, then 64 random bits per process
# (replicas may share an engine, a restarted server continues its sessions). 32 hex digits like a uuid4's, so none is
# a prefix of another (abort matches by prefix); the first 24 (a turn's tool-call ids, output.call_id_prefix) differ
# between any two turns of a process and, from a random start, between processes.
_RID_SUFFIX = secrets.token_hex(8)
_rids = itertools.count(secrets.randbits(63))


def new_rid() -> str:
    """A request id no other request of any replica has: the turn's (its reply ids, its first engine request) or a
    continuation's engine request."""
    return f"{next(_rids):016x}{_RID_SUFFIX}"


@dataclass(slots=True)
class Turn(Generic[R]):
    """One prepared turn: the request, its TITO plan and the ids it goes by.

    `rid` names the turn (its reply ids, its tool calls, its first engine request); `engine_rid` is the engine
    request running now, which is what an abort must name: a new one for each continuation (turns/resume.py).
    `engine_start` and `session_params` say how the turn's prompt reached the engine (all of it, or past what its
    SGLang streaming session holds); a continuation goes the same way."""

    request: TurnRequest[R]
    plan: TurnPlan
    rid: str
    model: str
    family: ModelFamily
    segment: SegmentPlan | None = None  # the segment matched (None: a caller without segments)
    created: int = field(default_factory=lambda: int(time.time()))
    engine_rid: str = ""
    engine_start: int = 0
    session_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.engine_rid = self.engine_rid or self.rid

    @property
    def headers(self) -> dict[str, str]:
        headers = rollback_headers(self.plan)
        if self.segment is not None and self.segment.segment:
            headers[SEGMENT_HEADER] = segment_header(self.segment)
        return headers


@dataclass(slots=True)
class NewTokens:
    """Tokens a stream event adds (ids, their logprobs and top alternatives), checked loosely: only what the final,
    validated event is later checked against is ever sent from them."""

    ids: np.ndarray
    logprobs: np.ndarray
    top: list[list[tuple[float, int]]] | None


class StreamFormat(Protocol):
    """How a front end writes a streamed turn. Each method returns the bytes to send (server-sent events)."""

    def start(self) -> Sequence[bytes]: ...
    def delta(self, delta: dict[str, Any] | None, tokens: NewTokens | None) -> Sequence[bytes]: ...
    def finish(self, out: TurnOutput, rest: dict[str, Any] | None, tokens: NewTokens | None) -> Sequence[bytes]: ...
    def end(self) -> bytes: ...  # the stream's last bytes, sent after the slot is released
    def error(self, err: SessionError) -> Sequence[bytes]: ...  # an error after the first byte


class FrontEnd(Protocol[R]):
    """An API over the turn pipeline. `parse` reads the session's trajectory only for what the request refers to
    (the Responses API's `previous_response_id`); it runs on the CPU pool and must not change it."""

    name: str  # the `api` label of its metrics

    def parse(self, body: bytes, trajectory: LinearTrajectory) -> TurnRequest[R]: ...
    def reply(self, turn: Turn[R], out: TurnOutput) -> bytes: ...  # a plain reply (runs on the CPU pool)
    def stream(self, turn: Turn[R]) -> StreamFormat: ...
    def error(self, err: SessionError) -> Response: ...  # an error before the first byte, in the API's shape
    def wants_logprobs(self, request: R) -> bool: ...  # whether stream deltas carry the new tokens' logprobs


class ChatReader(Protocol):
    """Reads a Chat Completions request object into a TurnRequest carrying the caller's own `api` value: what the
    Responses and Anthropic front ends map their requests onto, so every API honours a field with the same checks.
    Chat Completions provides it (openai/chat.py); the routes hand it to the others (a front end imports no other)."""

    def __call__(self, obj: dict[str, Any], family: ModelFamily, api: R) -> TurnRequest[R]: ...


ROLLBACK_HEADER = "X-Session-Rollback"


def rollback_headers(plan: TurnPlan) -> dict[str, str]:
    """`X-Session-Rollback: <turns dropped>; reason=<why>` on the turn that rolled back: a rollback discards
    generated turns from the training data, so the agent's side must be able to see it, never only the server."""
    if not plan.rolled_back:
        return {}
    return {ROLLBACK_HEADER: f"{plan.rolled_back}; reason={plan.rollback_reason or 'retry'}"}


SEGMENT_HEADER = "X-Session-Segment"


def segment_header(plan: SegmentPlan) -> str:
    """`X-Session-Segment: <id>` on every turn of a segment other than the session's first, and on the turn that
    starts it `<id>; started; reason=<why>; parent=<id>; branch_turn=<n>`: the agent's side sees that its history
    forked (a compaction, a sub-agent), as it sees a rollback."""
    start = plan.start
    if start is None:
        return str(plan.segment)
    return f"{plan.segment}; started; reason={start.reason}; parent={start.parent}; branch_turn={start.branch_turn}"


async def encode_payload(
    server: ServerState, turn: Turn[Any], prompt_ids: Any, sampling_params: dict[str, Any]
) -> bytes:
    """The /generate body of the turn's engine request now running (`turn.engine_rid`): `prompt_ids` past
    `turn.engine_start`, on the pool when large."""
    request, config = turn.request, server.config
    interval = stream_interval(config.engine_stream_interval, config.engine_incremental_streaming,
                               sampling_params.get("max_new_tokens"), server.prompt_token_limit)
    return await server.pool.run_sized(
        4 * (len(prompt_ids) - turn.engine_start), encode_generate, prompt_ids, turn.engine_start, sampling_params,
        turn.engine_rid, turn.session_params, config.return_routed_experts, request.top_logprobs, request.stream,
        turn.plan.routed_experts_start, interval, server.family.thinking_mode(request.template_kwargs),
    )


def engine_sessions_of(server: ServerState, claim: Claim) -> EngineSessions | None:
    """The SGLang streaming session of this turn: the session's first segment keeps one (--engine-sessions); other
    segments send their whole prompt, as a streaming session holds one history and takes one request at a time."""
    return server.engine_sessions if not claim.segment else None


def count_failure(metrics: Metrics, err: SessionError) -> None:
    """A turn that ended in an error, counted once by what it was: an abort by its reason, a refused limit, an engine
    reply that broke a rule. Every other error is counted only as its response."""
    reason: AbortReason | None = getattr(err, "abort_reason", None)
    if reason is not None:
        metrics.abort(reason)
    elif isinstance(err, LimitExceededError):
        metrics.refused(err.limit)
    elif isinstance(err, UpstreamError):
        metrics.validation_failure(err.rule)


async def commit_output(server: ServerState, claim: Claim, plan: TurnPlan, out: TurnOutput) -> TurnRecord:
    """The turn's tail, plain or streamed: the commit (journaled with --journal), its metrics, and the engine
    session's books (it now holds exactly the trajectory)."""
    metrics = server.metrics
    t0 = time.perf_counter()
    assert claim.plan is not None and claim.plan.turn is plan  # bound by the pipeline before the engine call
    record = await commit_turn(server, claim.session, claim.plan, out.result, out.message)
    metrics.stage("commit", time.perf_counter() - t0)
    if claim.plan.start is not None:
        metrics.segment_started(claim.plan.start.reason)
    metrics.turn_tokens(len(plan.prompt_ids), record.cached_tokens, record.completion_len)
    if plan.rolled_back:
        metrics.rollback(plan.rollback_reason or "retry")
    engine_sessions = engine_sessions_of(server, claim)
    if engine_sessions is not None:
        engine_sessions.committed(claim.session.id, len(plan.prompt_ids) + len(out.result.output_ids))
    return record
