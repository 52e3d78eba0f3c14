"""What a turn is, whatever API carried it, and how a front end meets the turn pipeline.

A front end (Chat Completions, Responses, Anthropic Messages) only translates: it parses its request into a
`TurnRequest` (the turn's messages and tools in the chat-template shape, the engine's sampling params) and formats
the turn's output -- a plain reply, a stream of events, its own error shape. Everything between is one pipeline:
the slot, the body, TITO and limits (pipeline.py), then the whole engine side -- the race, continuation, a lost engine
session, validation, the commit, the metrics -- in one engine call (engine_call.py), which a plain turn awaits and a
streamed one (stream.py) formats as it goes. A fix there holds for every API and both modes.
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

from session_server.engine.adapters import AdapterRef
from session_server.turns.output import TurnOutput
from trajectory import LinearTrajectory, ModelFamily, SegmentPlan, TurnPlan
from trajectory.errors import SessionError
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits

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
    return_token_ids: bool | None = None  # the request's own `return_token_ids` (None: the server's default)
    # With sampling masks on (turns/sampling_masks.py): the top-k bound of their rows; None: no masks asked for.
    sampling_mask_bound: int | None = None


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
    """One prepared turn: the request, its TITO plan and the ids it goes by (`rid` names its reply, its tool calls
    and its first engine request)."""

    request: TurnRequest[R]
    plan: TurnPlan
    rid: str
    model: str
    family: ModelFamily
    segment: SegmentPlan | None = None  # the segment matched (None: a caller without segments)
    created: int = field(default_factory=lambda: int(time.time()))
    return_token_ids: bool = False  # the reply carries the turn's token ids (frontend/token_ids.py)
    adapter: AdapterRef | None = None  # the LoRA adapter revision every engine request of the turn names

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

    # `images`: the bounds on the request's images (frontend/images.py reads them as the request is parsed).
    def parse(self, body: bytes, trajectory: LinearTrajectory,
              images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[R]: ...
    def reply(self, turn: Turn[R], out: TurnOutput) -> bytes: ...  # a plain reply (runs on the CPU pool)
    def stream(self, turn: Turn[R]) -> StreamFormat: ...
    def error(self, err: SessionError) -> Response: ...  # an error before the first byte, in the API's shape
    def wants_logprobs(self, request: R) -> bool: ...  # whether stream deltas carry the new tokens' logprobs


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
