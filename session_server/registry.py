"""Session registry: sessions by unguessable id, plus tombstones for deleted ones.

Ids are 128 random bits (secrets.token_hex(16)): a session URL is a capability, so it must not be guessable. After
DELETE the id is remembered (bounded, oldest forgotten first) so that a late engine result or a repeated DELETE gets a
404 that says "deleted" instead of reviving anything, and so an id can never be handed out twice.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trajectory import LinearTrajectory

    from .gate import Claim


@dataclass(eq=False, slots=True)
class EngineSessionState:
    """The SGLang streaming session backing a trajectory (--engine-sessions), and what it holds."""

    sid: str | None = None
    tokens: int = 0  # number of trajectory tokens the engine session holds (valid only when not dirty)
    dirty: bool = False  # an uncommitted turn ran in it: its contents no longer match the trajectory


@dataclass(eq=False, slots=True)
class Session:
    id: str
    trajectory: LinearTrajectory
    metadata: dict[str, Any]
    created_at: float = field(default_factory=time.time)
    # Guards every read-modify of `trajectory`; never held across an await on the engine or the pool.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    claim: Claim | None = None  # the in-flight chat, owned by gate.Claim
    closing: bool = False
    engine: EngineSessionState = field(default_factory=EngineSessionState)


class Registry:
    def __init__(self, max_tombstones: int = 100_000) -> None:
        self._sessions: dict[str, Session] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._max_tombstones = max_tombstones

    def create(self, trajectory: LinearTrajectory, metadata: dict[str, Any] | None = None) -> Session:
        while True:
            sid = secrets.token_hex(16)
            if sid not in self._sessions and sid not in self._tombstones:
                break
        session = Session(id=sid, trajectory=trajectory, metadata=metadata or {})
        self._sessions[sid] = session
        return session

    def get(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def is_tombstoned(self, sid: str) -> bool:
        return sid in self._tombstones

    def forget(self, sid: str) -> None:
        """Drop the session and leave a tombstone; idempotent."""
        if self._sessions.pop(sid, None) is None:
            return
        self._tombstones[sid] = None
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
