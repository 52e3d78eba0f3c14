"""A session's segments: histories that are not one line (docs/design.md 4).

Agents do not keep one linear conversation per episode. A coding harness compacts its history into a summary,
spawns sub-agents with conversations of their own and sends side requests (a title, a summary) while the main turn
runs. Each of those is a request that extends no stored history within the rollback window. Refusing it (400)
breaks the episode; forking a new trajectory on every such request shatters it into many samples. Here a session
holds one or more **segments**, each a `LinearTrajectory` exactly as a single-line session has, and a request is a
turn of the segment it extends (or rolls back within `max_rollback`, sharing at least its first message); a
request that extends none starts a new segment, rendered in full, which records its parent segment, the parent's
turn count when it started and why.

Matching is cheap, bounded and deterministic. One segment (every session until it diverges) is today's path:
`LinearTrajectory.prepare`, nothing added. With several, each segment's history is compared with the request's
messages up to their first difference (exact dict equality first, the message matcher only where that fails; no
render), the segments whose rollback window the request fits are ranked -- longest shared prefix, then fewer turns
rolled back, then not busy, then the lowest id -- and only the winner prepares (renders its appended messages). At
most `max_segments` segments exist (then a 400 that says so).

Optional merge: a new segment whose full render begins with every token of an existing segment (a harness that
re-sends its history in another shape, e.g. with a new system prompt after it, whose render still repeats exactly
what the model saw and sampled) becomes a turn of that segment instead (`LinearTrajectory.merge_plan`): one sequence
per episode where the tokens allow it, and no second sample that repeats the first one's tokens unmasked.

Ids are reserved before the engine call (`reserve`), so concurrent turns that start segments get distinct ids and
the bound counts them; `stage` + `apply` split the commit as LinearTrajectory's do (a journal writes in between).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from .engine_output import GenerateResult
from .errors import InvariantError, RequestValidationError, RollbackLimitError
from .linear import LinearTrajectory, TurnDelta, TurnPlan, TurnRecord
from .messages import Message, RollbackReason

# Why a segment exists: the session's first; a request that shares leading messages with a segment but leaves its
# history further back than the rollback window (a compaction that keeps the system prompt, an edited history); a
# request that shares no leading message with any segment (a sub-agent, a side request).
SegmentReason = Literal["first", "divergence", "new_conversation"]
SEGMENT_REASONS: tuple[str, ...] = get_args(SegmentReason)
DivergencePolicy = Literal["segment", "reject"]
DIVERGENCE_POLICIES: tuple[str, ...] = get_args(DivergencePolicy)


class SegmentLimitError(RequestValidationError):
    """A request would start a segment past `max_segments` (400)."""

    code = "segment_limit_exceeded"


@dataclass(eq=False, slots=True)
class Segment:
    """One linear history of a session, and where it came from."""

    id: int
    trajectory: LinearTrajectory
    parent: int | None = None       # the segment it left (longest shared prefix) or, sharing none, the latest
    branch_turn: int = 0            # the parent's turns when it started: it came after the parent's turn N
    reason: SegmentReason = "first"
    divergence: RollbackReason | None = None  # what differed first from the parent's history ("divergence")
    shared_messages: int = 0        # leading request messages that repeated the parent's history

    def info(self) -> dict[str, Any]:
        """Where the segment came from, as samples, GET /sessions/{id} and the journal carry it."""
        return {"segment": self.id, "parent": self.parent, "branch_turn": self.branch_turn, "reason": self.reason,
                "divergence": self.divergence, "shared_messages": self.shared_messages}


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """A turn of an existing segment (`start` None) or the first turn of a new one (`start`: the segment to add,
    its id -1 until `reserve`)."""

    turn: TurnPlan
    segment: int
    start: Segment | None = None

    @property
    def new_segment(self) -> bool:
        return self.start is not None


@dataclass(frozen=True, slots=True)
class SegmentDelta:
    """What one commit changes: a turn of `segment`, which `start` adds first when the turn starts it."""

    segment: int
    delta: TurnDelta
    start: Segment | None = None


class SegmentSet:
    """The segments of one session; see the module docstring for matching, reservation and merging."""

    def __init__(self, new_trajectory: Callable[[], LinearTrajectory], *, max_segments: int = 16,
                 on_divergence: str = "segment", merge: bool = False) -> None:
        if max_segments < 1:
            raise ValueError("max_segments must be >= 1")
        if on_divergence not in DIVERGENCE_POLICIES:
            raise ValueError(f"on_divergence must be one of {', '.join(DIVERGENCE_POLICIES)}")
        self._new_trajectory = new_trajectory
        self.max_segments = max_segments
        self.on_divergence = on_divergence
        self.merge = merge
        self.segments: dict[int, Segment] = {0: Segment(0, new_trajectory())}
        self.reserved: set[int] = set()
        self._next_id = 1
        self._latest = 0  # the segment of the latest commit: the parent of a segment that shares nothing

    # -- reading --------------------------------------------------------------------------------------------
    @property
    def main(self) -> LinearTrajectory:
        """The first segment's trajectory: all there is of a single-line session."""
        return self.segments[0].trajectory

    def __len__(self) -> int:
        return len(self.segments)

    def __iter__(self) -> Any:
        return iter(self.segments.values())

    def get(self, segment: int) -> Segment:
        return self.segments[segment]

    @property
    def latest(self) -> int:
        """The segment of the latest commit: the session's current segment (what a fork continues)."""
        return self._latest

    @property
    def num_tokens(self) -> int:
        return sum(s.trajectory.num_tokens for s in self.segments.values())

    @property
    def nbytes(self) -> int:
        return sum(s.trajectory.nbytes for s in self.segments.values())

    # -- prepare ------------------------------------------------------------------------------------------
    def prepare(self, messages: Any, tools: Any = None, template_kwargs: dict[str, Any] | None = None,
                busy: Mapping[int, Message] | None = None, messages_json: bytes | None = None) -> SegmentPlan:
        """The segment this request continues and its TITO plan, or a new segment's full render. Mutates nothing.

        `busy`: the segments with a turn in flight, each with that turn's first message. Among equally good matches a
        free one wins (a busy winner is the caller's 409). A segment whose first turn is in flight has no history
        yet: it takes a request that begins with that turn's first message (a duplicate: 409), any other starts a
        segment (a side request next to the first turn). RollbackLimitError under `on_divergence="reject"`;
        SegmentLimitError past `max_segments`. `messages_json`: as in `LinearTrajectory.prepare`.
        """
        busy = busy or {}
        if len(self.segments) == 1:  # a single-line session: exactly LinearTrajectory's turn, nothing added
            only = self.segments[0]
            if self._beside_first_turn(only, messages, busy):
                return self._start(messages, tools, template_kwargs, [(only, 0, None, None)], messages_json)
            try:
                plan = only.trajectory.prepare(messages, tools, template_kwargs, messages_json)
                # matched messages are the stored objects: a rollback whose first message is not shares nothing
                if self.on_divergence == "reject" or not plan.rolled_back \
                        or plan.messages[0] is only.trajectory.messages[0]:
                    return SegmentPlan(plan, only.id)
            except RollbackLimitError:
                if self.on_divergence == "reject":
                    raise
            return self._start(messages, tools, template_kwargs, [(only, *self._reach(only, messages))],
                               messages_json)
        ranked = [(segment, *self._reach(segment, messages)) for segment in self.segments.values()]
        ranked = [(s, m, None if self._beside_first_turn(s, messages, busy) else k, r) for s, m, k, r in ranked]
        fitting = [(s, matched, keep) for s, matched, keep, _ in ranked if keep is not None]
        if fitting:
            best, _, _ = min(fitting, key=lambda f: (-f[1], len(f[0].trajectory.checkpoints) - (f[2] or 0),
                                                      f[0].id in busy, f[0].id))
            return SegmentPlan(best.trajectory.prepare(messages, tools, template_kwargs, messages_json), best.id)
        if self.on_divergence == "reject":
            raise RollbackLimitError("the request's history extends no segment of the session within "
                                     f"max_rollback={self.main.max_rollback}")
        return self._start(messages, tools, template_kwargs, ranked, messages_json)

    def _beside_first_turn(self, segment: Segment, messages: Any, busy: Mapping[int, Message]) -> bool:
        """Is `segment` empty with a first turn in flight that the request does not begin like?"""
        if self.on_divergence == "reject" or segment.trajectory.checkpoints or segment.id not in busy:
            return False
        return segment.trajectory.matcher.common_prefix([busy[segment.id]], messages)[0] == 0

    @staticmethod
    def _reach(segment: Segment, messages: Any) -> tuple[int, int | None, RollbackReason | None]:
        """(shared leading messages, turns kept or None if the request does not fit, what differs first).

        A request fits a segment when it rolls back at most `max_rollback` turns and shares at least its first
        message: a side request or a sub-agent that shares nothing is a conversation of its own, never a retry
        that would drop the segment's turns.
        """
        traj = segment.trajectory
        matched, reason = traj.matcher.common_prefix(traj.messages, messages)
        return matched, traj.kept_turns(matched) if matched or not traj.checkpoints else None, reason

    def _start(self, messages: Any, tools: Any, template_kwargs: dict[str, Any] | None,
               ranked: list[tuple[Segment, int, int | None, RollbackReason | None]],
               messages_json: bytes | None = None) -> SegmentPlan:
        """A new segment: the request rendered in full; its parent is the segment sharing the longest prefix (ties:
        the latest committed to, then the lowest id), or the latest when none shares a message."""
        self.check_room()
        trajectory = self._new_trajectory()
        full = trajectory.prepare(messages, tools, template_kwargs, messages_json)
        if self.merge:
            for segment in sorted(self.segments.values(), key=lambda s: (s.id != self._latest, s.id)):
                merged = segment.trajectory.merge_plan(full)
                if merged is not None:
                    return SegmentPlan(merged, segment.id)
        parent, shared, _, divergence = min(
            ranked, key=lambda r: (-r[1], r[0].id != self._latest, r[0].id))
        if shared == 0:
            parent = self.segments.get(self._latest, parent)
        start = Segment(-1, trajectory, parent=parent.id, branch_turn=len(parent.trajectory.records),
                        reason="divergence" if shared else "new_conversation",
                        divergence=divergence if shared else None, shared_messages=shared)
        return SegmentPlan(full, -1, start)

    def check_room(self) -> None:
        if len(self.segments) + len(self.reserved) >= self.max_segments:
            raise SegmentLimitError(
                f"the request's history extends no segment of the session within max_rollback="
                f"{self.main.max_rollback}, and the session already has its maximum of {self.max_segments} "
                "segments (--max-segments)"
            )

    # -- reserve / commit ---------------------------------------------------------------------------------
    def reserve(self, plan: SegmentPlan) -> SegmentPlan:
        """Give a new segment its id before its engine call (400 past `max_segments`); a no-op for other plans."""
        if plan.start is None:
            return plan
        self.check_room()
        segment_id = self._next_id
        self._next_id += 1
        self.reserved.add(segment_id)
        return SegmentPlan(plan.turn, segment_id, replace(plan.start, id=segment_id))

    def unreserve(self, plan: SegmentPlan) -> None:
        """The reserved segment's turn ended without a commit: its id is not used."""
        if plan.start is not None:
            self.reserved.discard(plan.segment)

    def commit(self, plan: SegmentPlan, result: GenerateResult, reply_message: dict[str, Any]) -> TurnRecord:
        return self.apply(self.stage(plan, result, reply_message))

    def stage(self, plan: SegmentPlan, result: GenerateResult, reply_message: dict[str, Any]) -> SegmentDelta:
        """Validate a commit, mutating nothing (the journal writes the delta before `apply`)."""
        if plan.start is not None:
            if plan.segment not in self.reserved:
                raise InvariantError(f"segment {plan.segment} was not reserved")
            return SegmentDelta(plan.segment, plan.start.trajectory.stage(plan.turn, result, reply_message),
                                plan.start)
        if plan.segment not in self.segments:
            raise InvariantError(f"no segment {plan.segment}")
        return SegmentDelta(plan.segment, self.segments[plan.segment].trajectory.stage(
            plan.turn, result, reply_message))

    def apply(self, delta: SegmentDelta) -> TurnRecord:
        """Make a staged (or journaled) turn happen: a new segment is added with its first turn."""
        if delta.start is not None:
            if delta.segment in self.segments or delta.start.trajectory.version != delta.delta.version:
                raise InvariantError(f"segment {delta.segment} cannot start twice")
            record = delta.start.trajectory.apply(delta.delta)
            self.segments[delta.segment] = delta.start
            self.reserved.discard(delta.segment)
            self._next_id = max(self._next_id, delta.segment + 1)
        else:
            record = self.segments[delta.segment].trajectory.apply(delta.delta)
        self._latest = delta.segment
        if len(self.segments) > 1:
            # A request is compared with every segment's history, so it must be read as sent: one segment's stored
            # messages (what a resent history's bytes stand for, `SentHistory`) carry what the agent may have left
            # out (reasoning), which another segment's history would be compared with.
            for segment in self.segments.values():
                segment.trajectory.sent = None
        return record

    def restore(self, segment: Segment) -> None:
        """Add a segment rebuilt from a journal (its turns replayed into its trajectory)."""
        self.segments[segment.id] = segment
        self._next_id = max(self._next_id, segment.id + 1)

    # -- inspection ---------------------------------------------------------------------------------------
    def snapshot(self) -> list[tuple[Segment, LinearTrajectory]]:
        """Detached copies of every segment's trajectory (LinearTrajectory.snapshot), in id order."""
        return [(s, s.trajectory.snapshot()) for _, s in sorted(self.segments.items())]
