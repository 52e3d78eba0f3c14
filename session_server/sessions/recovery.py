"""Restart on a journal: rebuild every journaled session and tombstone into a fresh registry before serving.

Trajectories are rebuilt by replaying their stored turns (trajectory.restore), each segment's on its own, so GET,
samples and the next chat see exactly what was committed. Engine sessions are not restored: a restored session starts
without one and the next turn opens a new one and re-prefills (engine/sessions.py), as after an engine restart. Idle
clocks continue from the journaled wall-clock time of each session's last write, so the idle sweep expires a session as
it would have.
"""

from __future__ import annotations

from collections.abc import Callable

from session_server.sessions.journal import JournalError, Restored, wall_to_monotonic
from session_server.sessions.registry import Registry
from session_server.sessions.session import Session
from trajectory import ModelFamily, Segment, SegmentSet
from trajectory.forks import Lineage
from trajectory.restore import restore_trajectory


def restore_sessions(registry: Registry, family: ModelFamily, restored: Restored,
                     new_segments: Callable[[], SegmentSet]) -> int:
    """Put every restored session and tombstone into a fresh registry; returns the number of sessions."""
    for tomb_id, why in restored.tombstones:
        registry.restore_tombstone(tomb_id, why)
    for saved in restored.sessions:
        if saved.family != family.name:
            raise JournalError(
                f"journal session {saved.id} is of model family {saved.family!r} but the server runs "
                f"{family.name!r}: start with the journal's family or another --journal"
            )
        segments = new_segments()
        # The server's way with control-token spellings in message text (--special-tokens-in-content), as a fresh
        # trajectory of this server has it: not journaled, so a restart that changed it applies the new one.
        special_tokens = "text" if segments.get(0).trajectory.text_only else "engine"
        lineage = None if saved.lineage is None else Lineage.of_json(saved.lineage)
        try:
            for segment, turns in [(0, saved.turns), *sorted(saved.segment_turns.items())]:
                # a forked session's first segment: its parent's turns up to the fork, cut to the fork point(s)
                cuts = lineage.cuts if lineage is not None and segment == 0 else ()
                trajectory = restore_trajectory(family, turns, max_rollback=saved.max_rollback, matcher=saved.matcher,
                                                special_tokens=special_tokens, cuts=cuts)
                if segment == 0:
                    segments.get(0).trajectory = trajectory
                    continue
                info = saved.segment_infos[segment]
                segments.restore(Segment(segment, trajectory, parent=info["parent"], branch_turn=info["branch_turn"],
                                         reason=info["reason"], divergence=info["divergence"],
                                         shared_messages=info["shared_messages"]))
        except Exception as exc:
            raise JournalError(f"journal session {saved.id} cannot be replayed: {exc}") from exc
        registry.restore(Session(
            id=saved.id, segments=segments, metadata=saved.metadata, created_at=saved.created_at,
            last_active=wall_to_monotonic(saved.last_active), sampling_masks=saved.sampling_masks, lineage=lineage,
        ))
    return len(restored.sessions)
