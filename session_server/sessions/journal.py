"""--journal PATH: every session, committed turn and deletion in SQLite, so a killed server restarts with its sessions.

Why SQLite (the standard library's sqlite3, WAL mode): no server to run, atomic transactions, and a file an operator
can open with the `sqlite3` shell. What is stored (docs/design.md 7, durability):

    sessions    id, family, settings (max_rollback, matcher, sampling_masks), metadata, created_at, last_active
                (wall clock), and a forked session's lineage (trajectory/forks.py): its turns are copies of its
                parent's rows up to the fork, in the same transaction as its row, replayed and then cut to the fork
                point (`cuts`); and `primed`, the key of the primed prompt its first segment holds
    primes      a primed prompt (api/primes.py) as the request that primed it, once for every session that holds it
                (the primed session, a group's children): a restart renders it again (the same ids), so a primed
                session and its children come back primed, their buffers holding the prompt once; a row goes with
                the last session that names it
    turns       one row per committed turn, as deltas (trajectory/restore.py): appended prompt tokens, completion and
                logprobs as blobs, messages past the unchanged prefix, tools when changed, the record, routed experts;
                the segment it belongs to, and on a segment's first turn where the segment came from (Segment.info)
    tombstones  ids of deleted sessions and why, bounded like the in-memory ones (oldest pruned first)
    pause       at most one row: the /admin/pause in force (its mode), so a replica restarted during a weight update
                comes back paused (sessions/pause.py) instead of sending traffic to engines whose weights are changing
    engine_sessions  the engine session ids that may be open (engine/sessions.py's book): written before an open
                is sent, removed once closed, so a restart after a SIGKILL closes what the killed process left

Ordering and guarantees. The chat stages its commit (validated, nothing mutated), waits for the turn's row to be
written, then applies it in memory and replies: what a client received is on disk. A crash between the write and the
reply leaves a turn the client never saw; its retry of the same request diverges there and rolls it back through
the normal one-step rollback. `--journal-sync normal` (SQLite synchronous=NORMAL in WAL mode): a written turn
survives the server process being killed (SIGKILL, OOM), not a power loss or kernel crash; `full` (synchronous=FULL)
fsyncs the WAL on every commit and survives those too, for more write latency.

Off the event loop. One writer thread owns the connection; requests queue up and the thread writes everything
queued in one transaction (group commit: one fsync for many turns), then wakes each waiting chat. The chat awaits its
own write only, so a slow disk is latency of chats, never a stall of /health or of other sessions' reads. Encoding a
turn (blobs, JSON) happens on the writer thread too.

Compaction. Deleting a session deletes its rows in the same transaction as its tombstone; tombstones beyond the
bound are pruned. The database is created with auto_vacuum=INCREMENTAL and the writer returns free pages to the file
system when many accumulate, and the WAL is truncated after checkpoints (journal_size_limit), so the file's size
follows the live data, not the history of the run.

Schema versioning: PRAGMA application_id marks the file as ours and PRAGMA user_version is the schema version; a file
of another application, or of a newer or unknown schema, is refused with an error before anything is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from session_server.sessions.session import Session
from trajectory.errors import SessionError
from trajectory.linear import TurnDelta
from trajectory.messages import Message
from trajectory.restore import StoredTurn, store_turn

logger = logging.getLogger("session_server.sessions.journal")

APPLICATION_ID = 0x534A524E  # "SJRN"
# 2: turns carry their segment (1 is migrated on open: every turn of segment 0); 3: the pause table; 4: the
# engine_sessions table; 5: turns carry their sampling masks; 6: the sessions' lineage column (forks) (each added on
# open); 7: the primes table and the sessions' primed column
SCHEMA_VERSION = 7
SYNC_MODES = ("normal", "full")
MAX_BATCH = 512  # operations per transaction
VACUUM_FREE_PAGES = 2048  # return free pages to the file system once this many accumulate (8 MiB at 4 KiB pages)

_SCHEMA = """
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    family TEXT NOT NULL,
    settings TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_active REAL NOT NULL,
    lineage TEXT,
    primed TEXT
);
CREATE INDEX sessions_by_primed ON sessions (primed);
CREATE TABLE primes (
    id TEXT PRIMARY KEY,
    body BLOB NOT NULL
);
CREATE TABLE turns (
    n INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    base_checkpoints INTEGER NOT NULL,
    keep INTEGER NOT NULL,
    prompt_tail BLOB NOT NULL,
    output_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    messages_kept INTEGER NOT NULL,
    messages BLOB NOT NULL,
    tools BLOB,
    tools_changed INTEGER NOT NULL,
    record BLOB NOT NULL,
    routed_experts BLOB,
    segment INTEGER NOT NULL DEFAULT 0,
    segment_info BLOB,
    sampling_masks BLOB
);
CREATE UNIQUE INDEX turns_by_segment ON turns (session_id, segment, version);
CREATE TABLE tombstones (
    n INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    why TEXT NOT NULL,
    deleted_at REAL NOT NULL
);
CREATE TABLE pause (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    mode TEXT NOT NULL,
    since REAL NOT NULL
);
CREATE TABLE engine_sessions (
    sid TEXT PRIMARY KEY,
    session_id TEXT NOT NULL
);
"""

_TURN_COLUMNS = (
    "version", "base_checkpoints", "keep", "prompt_tail", "output_ids", "logprobs", "messages_kept", "messages",
    "tools", "tools_changed", "record", "routed_experts", "sampling_masks",
)
_encoder = msgspec.json.Encoder()


class JournalError(Exception):
    """The journal file cannot be used (wrong application, newer or unknown schema, unreadable): refuse to start."""


class JournalUnavailableError(SessionError):
    """A journal write failed: the change was not made (503); the client may retry."""

    status = 503
    code = "journal_unavailable"


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What a session row holds (written with the session's first write, refreshed clocks with every turn)."""

    id: str
    family: str
    max_rollback: int
    matcher: str
    metadata: dict[str, Any]
    created_at: float
    sampling_masks: bool | None = field(default=None, kw_only=True)  # Session.sampling_masks
    lineage: dict[str, Any] | None = field(default=None, kw_only=True)  # a forked session's (Lineage.to_json)
    primed: str | None = field(default=None, kw_only=True)  # the key of its primed prompt's row (Session.primed)

    @classmethod
    def of(cls, session: Session) -> SessionInfo:
        traj = session.trajectory
        return cls(
            id=session.id, family=traj.family.name, max_rollback=traj.max_rollback, matcher=traj.matcher.mode,
            metadata=session.metadata, created_at=session.created_at, sampling_masks=session.sampling_masks,
            lineage=None if session.lineage is None else session.lineage.to_json(), primed=session.primed,
        )


@dataclass(frozen=True, slots=True)
class RestoredSession(SessionInfo):
    """A session row read back at startup: the row's fields (SessionInfo, so what is written and what is read are
    declared once), its wall-clock last activity, and its turns in order."""

    last_active: float  # wall clock
    turns: list[StoredTurn] = field(default_factory=list)  # the first segment's
    # The other segments' turns, and where each segment came from (Segment.info, from its first stored turn).
    segment_turns: dict[int, list[StoredTurn]] = field(default_factory=dict)
    segment_infos: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass(slots=True)
class Restored:
    sessions: list[RestoredSession]
    tombstones: list[tuple[str, str]]  # (id, why), oldest first
    paused: str | None = None  # the mode of the /admin/pause in force when the file was last written, if any
    engine_sessions: list[tuple[str, str]] = field(default_factory=list)  # (session id, engine sid) maybe open
    primes: dict[str, bytes] = field(default_factory=dict)  # primed prompts' requests by key (SessionInfo.primed)


# -- operations the writer applies -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Create:
    info: SessionInfo
    last_active: float


@dataclass(frozen=True, slots=True)
class _Turn:
    info: SessionInfo
    delta: TurnDelta
    prev_messages: list[Message]
    prev_tools: list[dict[str, Any]] | None
    last_active: float
    segment: int = 0
    segment_info: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class _Fork:
    """Children of a fork: their rows and copies of the parent's turns of `segment` before `version`, all or none;
    with `prime`, the (key, request) of the primed prompt they hold, written in the same transaction."""

    parent_id: str
    segment: int
    version: int
    children: list[SessionInfo]
    at: float
    prime: tuple[str, bytes] | None = None


@dataclass(frozen=True, slots=True)
class _Prime:
    """A session primed: the request as a primes row under `key`, and the session's row naming it."""

    info: SessionInfo
    key: str
    body: bytes
    at: float


@dataclass(frozen=True, slots=True)
class _Delete:
    session_id: str
    why: str
    at: float


@dataclass(frozen=True, slots=True)
class _Pause:
    mode: str | None  # None: /admin/continue
    at: float


@dataclass(frozen=True, slots=True)
class _EngineSession:
    sid: str
    session_id: str | None  # None: closed (out of the book)


_Op = _Create | _Turn | _Fork | _Prime | _Delete | _Pause | _EngineSession
_STOP = object()


# The statements that take a journal of schema N to N + 1.
_MIGRATIONS = {
    1: ("ALTER TABLE turns ADD COLUMN segment INTEGER NOT NULL DEFAULT 0;"  # before segments: all of the first
        "ALTER TABLE turns ADD COLUMN segment_info BLOB;DROP INDEX turns_by_session;"
        "CREATE UNIQUE INDEX turns_by_segment ON turns (session_id, segment, version);"),
    2: "CREATE TABLE pause (id INTEGER PRIMARY KEY CHECK (id = 0), mode TEXT NOT NULL, since REAL NOT NULL);",
    3: "CREATE TABLE engine_sessions (sid TEXT PRIMARY KEY, session_id TEXT NOT NULL);",
    4: "ALTER TABLE turns ADD COLUMN sampling_masks BLOB;",
    5: "ALTER TABLE sessions ADD COLUMN lineage TEXT;",
    6: ("ALTER TABLE sessions ADD COLUMN primed TEXT;CREATE INDEX sessions_by_primed ON sessions (primed);"
        "CREATE TABLE primes (id TEXT PRIMARY KEY, body BLOB NOT NULL);"),
}


def _check_schema(conn: sqlite3.Connection, path: str) -> bool:
    """True if the file is a fresh database (to be created), False if it is a journal of our schema; else raise."""
    app = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    if app == 0 and version == 0 and tables == 0:
        return True
    if app != APPLICATION_ID:
        raise JournalError(f"{path} is not a session-server journal (SQLite application_id {app:#x})")
    if version > SCHEMA_VERSION:
        raise JournalError(
            f"{path} was written by a newer session-server (journal schema {version}; this one reads "
            f"{SCHEMA_VERSION}): refusing to read it. Upgrade the server or start with another --journal"
        )
    if version not in _MIGRATIONS and version != SCHEMA_VERSION:
        raise JournalError(f"{path} has an unknown journal schema version {version} (this server reads "
                           f"{SCHEMA_VERSION})")
    if version != SCHEMA_VERSION:  # one transaction: every step up to the current schema, or none
        steps = "".join(_MIGRATIONS[v] for v in range(version, SCHEMA_VERSION))
        conn.executescript(f"BEGIN IMMEDIATE;{steps}PRAGMA user_version = {SCHEMA_VERSION};COMMIT;")
    return False


class Journal:
    """The journal file and its writer thread. `open()` (sync, at startup) validates and reads it; `start()` begins
    accepting writes from the event loop; `close()` drains the queue and closes the file."""

    def __init__(self, path: str | Path, sync: str = "normal", max_tombstones: int = 100_000) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"--journal-sync must be one of {', '.join(SYNC_MODES)}")
        self.path = str(path)
        self.sync = sync
        self.max_tombstones = max_tombstones
        self._conn: sqlite3.Connection | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0  # operations queued or being written (read by the metrics gauge)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batches_since_vacuum = 0
        self.failed_writes = 0

    # -- startup -------------------------------------------------------------------------------------------
    def open(self) -> Restored:
        """Open (or create) the file, check its schema and read every session, turn and tombstone in it."""
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise JournalError(f"cannot open journal {self.path}: {exc}") from exc
        try:
            fresh = _check_schema(conn, self.path)
            if fresh:
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # must precede the first table
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise JournalError(f"journal {self.path}: SQLite refused WAL mode (got {mode})")
            conn.execute(f"PRAGMA synchronous = {self.sync.upper()}")
            conn.execute("PRAGMA journal_size_limit = 67108864")
            if fresh:
                conn.executescript(  # one transaction: a crash here leaves an empty file, never half a schema
                    f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA application_id = {APPLICATION_ID};"
                    f"PRAGMA user_version = {SCHEMA_VERSION};COMMIT;"
                )
            restored = self._read(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise JournalError(f"cannot read journal {self.path}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return restored

    @staticmethod
    def _read(conn: sqlite3.Connection) -> Restored:
        sessions: dict[str, RestoredSession] = {}
        for sid, family, settings, metadata, created_at, last_active, lineage, primed in conn.execute(
            "SELECT id, family, settings, metadata, created_at, last_active, lineage, primed FROM sessions"
        ):
            s = msgspec.json.decode(settings)
            sessions[sid] = RestoredSession(
                id=sid, family=family, max_rollback=int(s["max_rollback"]), matcher=str(s["matcher"]),
                metadata=msgspec.json.decode(metadata), created_at=created_at, last_active=last_active,
                sampling_masks=s.get("sampling_masks"),
                lineage=None if lineage is None else msgspec.json.decode(lineage), primed=primed,
            )
        cols = ", ".join(_TURN_COLUMNS)
        for row in conn.execute(
            f"SELECT session_id, segment, segment_info, {cols} FROM turns ORDER BY session_id, segment, version"
        ):
            session = sessions.get(row[0])
            if session is None:
                raise JournalError(f"journal has turns of session {row[0]} but no session row")
            values = dict(zip(_TURN_COLUMNS, row[3:], strict=True))
            values["tools_changed"] = bool(values["tools_changed"])
            segment, info = row[1], row[2]
            turns = session.turns if segment == 0 else session.segment_turns.setdefault(segment, [])
            turns.append(StoredTurn(**values))
            if info is not None:
                session.segment_infos[segment] = msgspec.json.decode(info)
        tombstones = [(sid, why) for sid, why in conn.execute("SELECT id, why FROM tombstones ORDER BY n")]
        paused = conn.execute("SELECT mode FROM pause").fetchone()
        engine_sessions = [(session_id, sid) for sid, session_id in conn.execute(
            "SELECT sid, session_id FROM engine_sessions ORDER BY rowid")]
        primes = {key: bytes(body) for key, body in conn.execute("SELECT id, body FROM primes")}
        return Restored(sessions=list(sessions.values()), tombstones=tombstones,
                        paused=None if paused is None else str(paused[0]), engine_sessions=engine_sessions,
                        primes=primes)

    def start(self) -> None:
        """Begin writing: call on the event loop that will await the writes."""
        if self._conn is None:
            raise RuntimeError("Journal.open() first")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Write everything queued, checkpoint the WAL into the file and close it. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(_STOP)
            await asyncio.to_thread(thread.join)
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()

    @property
    def queue_depth(self) -> int:
        return self._pending

    # -- writes (on the event loop) -------------------------------------------------------------------------
    def _submit(self, op: _Op) -> asyncio.Future[None]:
        if self._loop is None or self._thread is None:
            raise JournalUnavailableError("the journal is not accepting writes")
        future: asyncio.Future[None] = self._loop.create_future()
        self._pending += 1
        self._queue.put((op, future))
        return future

    async def _write(self, op: _Op) -> None:
        await self._submit(op)

    async def created(self, info: SessionInfo) -> None:
        await self._write(_Create(info, time.time()))

    def created_later(self, info: SessionInfo) -> None:
        """Journal a creation without waiting (a session made on demand; its first turn writes the row anyway)."""
        self._later(_Create(info, time.time()))

    def write_turn(self, info: SessionInfo, delta: TurnDelta, prev_messages: list[Message],
                   prev_tools: list[dict[str, Any]] | None, segment: int = 0,
                   segment_info: dict[str, Any] | None = None) -> asyncio.Future[None]:
        """Queue a staged turn of `segment` (`segment_info` on the turn that starts it); the future resolves once it
        is on disk (JournalUnavailableError if it is not)."""
        return self._submit(_Turn(info, delta, prev_messages, prev_tools, time.time(), segment, segment_info))

    async def forked(self, parent_id: str, segment: int, version: int, children: list[SessionInfo],
                     prime: tuple[str, bytes] | None = None) -> None:
        """The children of a fork are on disk (rows and their copies of the parent's turns, and with `prime` the
        primed prompt they hold as (key, request)) or none is."""
        await self._write(_Fork(parent_id, segment, version, children, time.time(), prime))

    async def primed(self, info: SessionInfo, key: str, body: bytes) -> None:
        """The session `info` is primed with the request `body` (api/primes.py), kept under `key`."""
        await self._write(_Prime(info, key, body, time.time()))

    async def deleted(self, session_id: str, why: str) -> None:
        await self._write(_Delete(session_id, why, time.time()))

    def engine_session_opening(self, session_id: str, sid: str) -> None:
        """Book an engine session id before its open is sent (not waited for: see engine/sessions.py)."""
        self._later(_EngineSession(sid, session_id))

    def engine_session_gone(self, sid: str) -> None:
        """The engine session is closed (or moot): out of the book."""
        self._later(_EngineSession(sid, None))

    def _later(self, op: _Op) -> None:
        """Queue a write nobody waits for; a failure is logged by the writer."""
        future = self._submit(op)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def paused(self, mode: str | None) -> None:
        """Record the /admin/pause in force (`mode`), or that none is (None: /admin/continue)."""
        await self._write(_Pause(mode, time.time()))

    # -- the writer thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[tuple[_Op, asyncio.Future[None]]] = []
            item = self._queue.get()
            while True:
                if item is _STOP:
                    stop = True
                else:
                    batch.append(item)
                if stop or len(batch) >= MAX_BATCH:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._write_batch(batch)

    def _write_batch(self, batch: list[tuple[_Op, asyncio.Future[None]]]) -> None:
        conn = self._conn
        assert conn is not None
        errors: list[BaseException | None] = [None] * len(batch)
        failed: BaseException | None = None
        deletes = False
        try:
            conn.execute("BEGIN IMMEDIATE")
            for i, (op, _) in enumerate(batch):
                conn.execute("SAVEPOINT op")
                try:
                    self._apply(conn, op)
                    conn.execute("RELEASE op")
                except Exception as exc:  # one bad operation fails alone
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    errors[i] = exc
                deletes = deletes or isinstance(op, _Delete)
            conn.execute("COMMIT")
        except Exception as exc:
            failed = exc
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        if failed is not None or any(errors):
            self.failed_writes += sum(1 for e in errors if e) if failed is None else len(batch)
            logger.error("journal write failed: %r", failed or next(e for e in errors if e))
        if deletes and failed is None:
            self._maybe_vacuum(conn)
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            self._loop.call_soon_threadsafe(self._resolve, batch, errors, failed)

    def _resolve(
        self, batch: list[tuple[_Op, asyncio.Future[None]]], errors: list[BaseException | None],
        failed: BaseException | None,
    ) -> None:
        self._pending -= len(batch)
        for (_, future), error in zip(batch, errors, strict=True):
            if future.done():
                continue
            problem = failed or error
            if problem is None:
                future.set_result(None)
            else:
                future.set_exception(JournalUnavailableError(f"journal write failed: {problem}"))

    def _apply(self, conn: sqlite3.Connection, op: _Op) -> None:
        if isinstance(op, _Create):
            self._upsert_session(conn, op.info, op.last_active)
        elif isinstance(op, _Turn):
            # The row usually exists (POST /sessions wrote it): refresh the clock without re-encoding the rest.
            if not conn.execute("UPDATE sessions SET last_active = ? WHERE id = ?",
                                (op.last_active, op.info.id)).rowcount:
                self._upsert_session(conn, op.info, op.last_active)
            stored = store_turn(op.delta, op.prev_messages, op.prev_tools)
            values = [getattr(stored, c) for c in _TURN_COLUMNS]
            info = None if op.segment_info is None else _encoder.encode(op.segment_info)
            conn.execute(
                f"INSERT INTO turns (session_id, segment, segment_info, {', '.join(_TURN_COLUMNS)}) "
                f"VALUES (?, ?, ?, {', '.join('?' * len(_TURN_COLUMNS))})",
                [op.info.id, op.segment, info, *values],
            )
        elif isinstance(op, _Prime):
            self._upsert_session(conn, op.info, op.at)
            was = conn.execute("SELECT primed FROM sessions WHERE id = ?", (op.info.id,)).fetchone()
            conn.execute("INSERT OR REPLACE INTO primes (id, body) VALUES (?, ?)", (op.key, op.body))
            conn.execute("UPDATE sessions SET primed = ? WHERE id = ?", (op.key, op.info.id))
            self._drop_prime(conn, was[0] if was is not None else None)  # primed again: the old one, if unheld
        elif isinstance(op, _Fork):
            cols = ", ".join(_TURN_COLUMNS)
            if op.prime is not None:
                conn.execute("INSERT OR REPLACE INTO primes (id, body) VALUES (?, ?)", op.prime)
            for child in op.children:
                self._upsert_session(conn, child, op.at)
                conn.execute(
                    f"INSERT INTO turns (session_id, segment, segment_info, {cols}) SELECT ?, 0, NULL, {cols} "
                    "FROM turns WHERE session_id = ? AND segment = ? AND version < ? ORDER BY version",
                    (child.id, op.parent_id, op.segment, op.version),
                )
        elif isinstance(op, _EngineSession):
            if op.session_id is None:
                conn.execute("DELETE FROM engine_sessions WHERE sid = ?", (op.sid,))
            else:
                conn.execute("INSERT OR REPLACE INTO engine_sessions (sid, session_id) VALUES (?, ?)",
                             (op.sid, op.session_id))
        elif isinstance(op, _Pause):
            conn.execute("DELETE FROM pause")
            if op.mode is not None:
                conn.execute("INSERT INTO pause (id, mode, since) VALUES (0, ?, ?)", (op.mode, op.at))
        else:
            primed = conn.execute("SELECT primed FROM sessions WHERE id = ?", (op.session_id,)).fetchone()
            conn.execute("DELETE FROM turns WHERE session_id = ?", (op.session_id,))
            conn.execute("DELETE FROM sessions WHERE id = ?", (op.session_id,))
            self._drop_prime(conn, primed[0] if primed is not None else None)
            conn.execute(
                "INSERT INTO tombstones (id, why, deleted_at) VALUES (?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET why = excluded.why, deleted_at = excluded.deleted_at",
                (op.session_id, op.why, op.at),
            )
            conn.execute(
                "DELETE FROM tombstones WHERE n <= (SELECT max(n) FROM tombstones) - ?", (self.max_tombstones,)
            )

    @staticmethod
    def _drop_prime(conn: sqlite3.Connection, key: str | None) -> None:
        """Delete the primed prompt `key` unless a session still holds it."""
        if key is not None:
            conn.execute("DELETE FROM primes WHERE id = ?1 AND NOT EXISTS (SELECT 1 FROM sessions WHERE primed = ?1)",
                         (key,))

    @staticmethod
    def _upsert_session(conn: sqlite3.Connection, info: SessionInfo, last_active: float) -> None:
        conn.execute(
            "INSERT INTO sessions (id, family, settings, metadata, created_at, last_active, lineage, primed) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET last_active = excluded.last_active",
            (info.id, info.family,
             _encoder.encode({"max_rollback": info.max_rollback, "matcher": info.matcher,
                              "sampling_masks": info.sampling_masks}).decode(),
             _encoder.encode(info.metadata).decode(), info.created_at, last_active,
             None if info.lineage is None else _encoder.encode(info.lineage).decode(), info.primed),
        )

    def _maybe_vacuum(self, conn: sqlite3.Connection) -> None:
        self._batches_since_vacuum += 1
        if self._batches_since_vacuum < 64:
            return
        self._batches_since_vacuum = 0
        try:
            if conn.execute("PRAGMA freelist_count").fetchone()[0] >= VACUUM_FREE_PAGES:
                conn.execute("PRAGMA incremental_vacuum")
        except sqlite3.Error as exc:
            logger.warning("journal incremental vacuum failed: %r", exc)


def table_rows(path: str | Path) -> dict[str, int]:
    """Rows per table of a journal file, for an operator's look at it (the demo's summary, the crash soak's check
    that deleted sessions left only tombstones)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("sessions", "turns", "tombstones")}


def file_bytes(path: str | Path) -> int:
    """The journal's size on disk: the database file and, while it is open, its WAL and shared-memory files."""
    return sum(p.stat().st_size for p in (Path(path), Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists())


def wall_to_monotonic(wall: float, now_wall: Callable[[], float] = time.time,
                      now_mono: Callable[[], float] = time.monotonic) -> float:
    """A journaled wall-clock instant on this process's monotonic clock (the idle sweep's), never in the future."""
    return now_mono() - max(0.0, now_wall() - wall)
