"""Restart on a journal: rebuild every journaled session and tombstone into a fresh registry before serving.

Trajectories are rebuilt by replaying their stored turns (trajectory.restore), each segment's on its own, so GET,
samples and the next chat see exactly what was committed. Engine sessions are not restored: a restored session starts
without one and the next turn opens a new one and re-prefills (engine/sessions.py), as after an engine restart. Idle
clocks continue from the journaled wall-clock time of each session's last write, so the idle sweep expires a session as
it would have. A primed prompt is rendered again from its journaled request, once for every session that holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from session_server.sessions.journal import JournalError, Restored, wall_to_monotonic
from session_server.sessions.registry import Registry
from session_server.sessions.session import Session
from trajectory import ModelFamily, Segment, SegmentSet
from trajectory.forks import Lineage
from trajectory.linear import PrimedPrompt
from trajectory.restore import restore_trajectory

logger = logging.getLogger("session_server.sessions.recovery")


def restore_sessions(registry: Registry, family: ModelFamily, restored: Restored,
                     new_segments: Callable[[], SegmentSet],
                     primer: Callable[[bytes], PrimedPrompt] | None = None) -> int:
    """Put every restored session and tombstone into a fresh registry; returns the number of sessions. `primer`
    renders a journaled prime request again (api/primes.py), once per key for every session that holds it."""
    for tomb_id, why in restored.tombstones:
        registry.restore_tombstone(tomb_id, why)
    primes: dict[str, PrimedPrompt | None] = {}

    def primed_of(key: str | None) -> PrimedPrompt | None:
        if key is None or primer is None or key not in restored.primes:
            return None
        if key not in primes:
            try:
                primes[key] = primer(restored.primes[key])
            except Exception as exc:  # e.g. an image URL gone: its sessions' first turns render as unprimed ones do
                logger.warning("journaled primed prompt %s cannot be rendered again (%r): its sessions come back "
                               "unprimed", key, exc)
                primes[key] = None
        return primes[key]

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
                                                special_tokens=special_tokens, cuts=cuts,
                                                primed=primed_of(saved.primed) if segment == 0 else None)
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
            primed=saved.primed,
        ))
    return len(restored.sessions)
