"""Forks: one session's history as the start of N sessions (POST /sessions/{id}/fork; issue 39, tree rollouts).

A GRPO group is a tree of depth one (G episodes that begin with the same prompt) and tree rollouts (Tree-GRPO,
TreePO, ARPO) branch at turn boundaries. A fork gives each child the parent's current segment up to a turn boundary
(the end by default): its tokens, loss mask, logprobs, records (weight versions, routed experts), messages, images
and rendered-history state, so the child's next turn sends the engine exactly the ids the parent's next turn would
have sent from that point (`LinearTrajectory.fork`). The stored tokens are shared copy on write (TokenBuffer.share):
a child costs a few hundred bytes whatever the history's length; its first write copies them.

A GRPO group forks at the prompt: its parent is primed (`LinearTrajectory.prime`, POST /sessions/{id}/prime: the
first request rendered and tokenized once, no turn) and forked with no turn taken; every child shares the primed
prompt and its first turn sends those ids without rendering them, and the fork position is the prompt's length.

The child is an ordinary session afterwards. What it keeps of where it came from is its `Lineage`: the parent
session, the segment and turn it left, the fork position in tokens, the fork's group (the N siblings of one call)
and the tree's root and depth -- what a trainer needs for tree or group advantages and to de-duplicate the shared
prefix. `cuts` is how the journal replays it (sessions/journal.py copies the parent's stored turns up to the fork
and replays them, then cuts to the fork point; a fork of a fork inherits its parent's cuts).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ForkPointError, RequestValidationError
from .session_segments import SegmentSet


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a forked session came from."""

    parent: str  # the parent session's id
    segment: int  # the parent's segment the child continues
    turns: int  # the parent segment's turns the child holds
    position: int  # the fork position in tokens: the child's inherited prefix is ids[:position]
    group: str  # shared by the N children of one fork call
    root: str  # the tree's root session
    depth: int  # 1 for a child of a session that was not forked
    version: int  # the parent segment's trajectory version at the fork (what the journal replays up to)
    cuts: tuple[tuple[int, int], ...] = ()  # (version, turns): every fork on the way from the root, in order

    def info(self) -> dict[str, Any]:
        """The lineage as samples and GET /sessions/{id} carry it."""
        return {"parent_session": self.parent, "fork_segment": self.segment, "fork_turns": self.turns,
                "fork_position": self.position, "group": self.group, "root_session": self.root, "depth": self.depth}

    def to_json(self) -> dict[str, Any]:
        """What the journal stores (`of_json` reads it back)."""
        return {**self.info(), "version": self.version, "cuts": [list(c) for c in self.cuts]}

    @classmethod
    def of_json(cls, raw: dict[str, Any]) -> Lineage:
        return cls(parent=raw["parent_session"], segment=int(raw["fork_segment"]), turns=int(raw["fork_turns"]),
                   position=int(raw["fork_position"]), group=raw["group"], root=raw["root_session"],
                   depth=int(raw["depth"]), version=int(raw["version"]),
                   cuts=tuple((int(v), int(t)) for v, t in raw["cuts"]))


@dataclass(frozen=True, slots=True)
class ForkPlan:
    """N children's segments (each one segment holding the forked history), and the lineage they share but their
    ids (`lineage_of`)."""

    children: list[SegmentSet]
    segment: int
    turns: int
    position: int
    version: int
    group: str

    def lineage_of(self, parent_id: str, parent: Lineage | None) -> Lineage:
        """The children's lineage under a parent of id `parent_id` with its own lineage (None: a root)."""
        inherited = parent.cuts if parent is not None and self.segment == 0 else ()
        return Lineage(parent=parent_id, segment=self.segment, turns=self.turns, position=self.position,
                       group=self.group, root=parent.root if parent is not None else parent_id,
                       depth=parent.depth + 1 if parent is not None else 1, version=self.version,
                       cuts=(*inherited, (self.version, self.turns)))


def parse_fork(n: Any, at: Any, max_fork: int) -> tuple[int, int | None]:
    """The request's `n` (1..max_fork) and `at` (a turn count of the current segment, "end" or absent: None)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestValidationError("'n' must be an integer >= 1")
    if n > max_fork:
        raise RequestValidationError(f"'n' is {n}; a fork creates at most {max_fork} sessions (--max-fork)")
    if at is None or at == "end":
        return n, None
    if isinstance(at, bool) or not isinstance(at, int):
        raise ForkPointError("'at' must be \"end\" or the number of turns of the session's current segment to keep")
    return n, at


def plan_fork(segments: SegmentSet, new_segments: Callable[[], SegmentSet], n: int, at: int | None) -> ForkPlan:
    """Fork the current segment (the latest committed to) at turn boundary `at` (None: its end) into `n` children.
    Mutates nothing of the parent but marking its shared tokens copy on write; ForkPointError for a bad `at`."""
    segment = segments.get(segments.latest)
    source = segment.trajectory
    first = source.fork(at)  # validates `at`
    turns = len(first.checkpoints)
    children = []
    for i in range(n):
        child = new_segments()
        child.get(0).trajectory = first if i == 0 else source.fork(turns)
        children.append(child)
    position = first.num_tokens if turns or first.primed is None else first.primed.num_tokens
    return ForkPlan(children=children, segment=segment.id, turns=turns, position=position,
                    version=source.version, group=secrets.token_hex(8))
