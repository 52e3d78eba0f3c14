"""Session registry: sessions by unguessable id, plus tombstones for deleted ones.

Ids are 128 random bits (secrets.token_hex(16)): a session URL is a capability, so it must not be guessable. A replica
behind a load balancer (--replica-name) prefixes them with its name and a dot, `r1.<hex>`: the balancer routes an id
to the replica named in it (deploy/nginx.py), so a session stays where it was created whatever the pool. After
DELETE (or the idle sweep) the id is remembered so that a late engine result or a repeated DELETE gets a 404 that says
why instead of reviving anything, and so an id is not handed out twice. Tombstones are bounded by count, oldest
forgotten first (`max_tombstones`, about 200 bytes each): a long-running server deletes millions of sessions, and a
forgotten id only turns "was deleted" into "not found" -- it is still a 404 and still cannot be revived.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any

from session_server.errors import SessionNotFoundError
from session_server.sessions.session import Session
from trajectory import SegmentSet


class Registry:
    def __init__(self, max_tombstones: int = 100_000, id_prefix: str = "") -> None:
        if max_tombstones < 0:
            raise ValueError("max_tombstones must be >= 0")
        self._id_prefix = id_prefix  # "NAME." behind a load balancer, else empty
        self._sessions: dict[str, Session] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()  # id -> why it is gone, oldest first
        self._max_tombstones = max_tombstones

    def create(self, segments: SegmentSet, metadata: dict[str, Any] | None = None,
               sampling_masks: bool | None = None) -> Session:
        return self.create_named(self.mint(), segments, metadata, sampling_masks)

    def mint(self) -> str:
        """A new id, neither live nor tombstoned, carrying the replica's name (what routes it back here)."""
        while True:
            sid = self._id_prefix + secrets.token_hex(16)
            if not self.knows(sid):
                return sid

    def create_named(self, sid: str, segments: SegmentSet, metadata: dict[str, Any] | None = None,
                     sampling_masks: bool | None = None) -> Session:
        """A session under an id the client chose (X-Session-ID with --create-sessions-on-demand).

        A live or tombstoned id is refused: a late request must never revive a deleted episode under its old id.
        """
        session = Session(id=sid, segments=segments, metadata=metadata or {}, sampling_masks=sampling_masks)
        self._insert(session)
        return session

    def restore(self, session: Session) -> None:
        """Put back a session read from the journal (sessions/recovery.py), under its own id."""
        self._insert(session)

    def _insert(self, session: Session) -> None:
        if self.knows(session.id):
            raise ValueError(f"session id {session.id!r} is taken")
        self._sessions[session.id] = session

    def knows(self, sid: str) -> bool:
        """Whether `sid` is live or tombstoned: such an id is never handed out again, so nothing revives a deleted
        episode under its old id (a live one answers for itself, a tombstoned one with a 404 that says why)."""
        return sid in self._sessions or sid in self._tombstones

    def restore_tombstone(self, sid: str, why: str) -> None:
        """Put back a journaled tombstone (oldest first, so the bound evicts the same ones it would have)."""
        self._bury(sid, why)

    def _bury(self, sid: str, why: str) -> None:
        """Tombstone `sid` as the newest, forgetting the oldest beyond `max_tombstones` (the memory bound)."""
        self._tombstones[sid] = why
        self._tombstones.move_to_end(sid)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    def discard(self, sid: str) -> None:
        """Drop a session that never became visible (its creation could not be journaled): no tombstone."""
        self._sessions.pop(sid, None)

    def get(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def require(self, sid: str) -> Session:
        """The live session, marked active now; 404 if unknown, deleted or being deleted (docs/design.md 3 order)."""
        session = self._sessions.get(sid)
        if session is None:
            gone = self._tombstones.get(sid)
            raise SessionNotFoundError(f"session {sid} {gone}" if gone else f"session {sid} not found")
        if session.closing:
            raise SessionNotFoundError(f"session {sid} is being deleted")
        session.last_active = time.monotonic()
        return session

    def touch_all(self) -> None:
        """Mark every live session active now (after a pause, which must not count as idleness)."""
        now = time.monotonic()
        for session in self._sessions.values():
            session.last_active = now

    def is_tombstoned(self, sid: str) -> bool:
        return sid in self._tombstones

    @property
    def num_tombstones(self) -> int:
        return len(self._tombstones)

    def forget(self, sid: str, why: str = "was deleted") -> None:
        """Drop the session and leave a tombstone (evicting the oldest beyond the bound); idempotent."""
        if self._sessions.pop(sid, None) is None:
            return
        self._bury(sid, why)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
