"""session_server.sessions.registry: unguessable ids, tombstones that never let a deleted id come back, a bound on them.

A session URL is a capability: ids are 128 random bits (with the replica's prefix behind a load balancer) and an id
live or remembered as deleted is never handed out or accepted again. Tombstones are bounded, oldest forgotten first.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from session_server.errors import SessionNotFoundError
from session_server.sessions import registry as registry_module
from session_server.sessions.registry import Registry
from session_server.sessions.session import Session
from trajectory import LinearTrajectory, ModelFamily, SegmentSet


def segments(family: ModelFamily) -> SegmentSet:
    return SegmentSet(lambda: LinearTrajectory(family))


def test_ids_are_128_random_bits_under_the_replica_prefix(family: ModelFamily) -> None:
    plain, prefixed = Registry(), Registry(id_prefix="r1.")
    ids = [plain.create(segments(family)).id for _ in range(50)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 50
    sid = prefixed.create(segments(family), {"episode": 3}).id
    assert re.fullmatch(r"r1\.[0-9a-f]{32}", sid)
    assert prefixed.require(sid).metadata == {"episode": 3}
    assert len(plain) == 50 and len(plain.sessions()) == 50


def test_a_minted_id_is_never_one_the_registry_knows(family: ModelFamily, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the random source to repeat a live or a tombstoned id, the registry draws again rather than hand it out."""
    reg = Registry()
    live = reg.create_named("a" * 32, segments(family))
    reg.create_named("b" * 32, segments(family))
    reg.forget("b" * 32)
    draws: Iterator[str] = iter(["a" * 32, "b" * 32, "c" * 32])
    monkeypatch.setattr(registry_module.secrets, "token_hex", lambda _n: next(draws))
    fresh = reg.create(segments(family))
    assert fresh.id == "c" * 32 and reg.get("a" * 32) is live


def test_a_live_or_tombstoned_id_is_refused(family: ModelFamily) -> None:
    reg = Registry()
    reg.create_named("x", segments(family))
    with pytest.raises(ValueError, match="taken"):
        reg.create_named("x", segments(family))
    reg.forget("x")
    with pytest.raises(ValueError, match="taken"):  # a late request must never revive a deleted episode
        reg.create_named("x", segments(family))
    with pytest.raises(ValueError, match="taken"):
        reg.restore(Session(id="x", segments=segments(family), metadata={}))
    assert reg.get("x") is None and reg.knows("x")


def test_require_says_why_a_session_is_gone_and_marks_a_live_one_active(family: ModelFamily) -> None:
    reg = Registry()
    with pytest.raises(SessionNotFoundError, match="session nope not found"):
        reg.require("nope")
    session = reg.create_named("s", segments(family))
    session.last_active = 0.0
    before = time.monotonic()
    assert reg.require("s") is session and session.last_active >= before
    session.closing = True
    with pytest.raises(SessionNotFoundError, match="being deleted"):
        reg.require("s")
    reg.forget("s", "expired after being idle")
    with pytest.raises(SessionNotFoundError, match="session s expired after being idle"):
        reg.require("s")
    assert reg.is_tombstoned("s") and reg.get("s") is None and len(reg) == 0


def test_forget_is_idempotent_and_discard_leaves_no_tombstone(family: ModelFamily) -> None:
    reg = Registry()
    reg.create_named("s", segments(family))
    reg.forget("s")
    reg.forget("s", "expired after being idle")  # the second forget changes nothing, not even the reason
    with pytest.raises(SessionNotFoundError, match="s was deleted"):
        reg.require("s")
    assert reg.num_tombstones == 1
    reg.forget("never-existed")  # nothing to bury
    assert not reg.knows("never-existed") and reg.num_tombstones == 1
    # A session whose creation could not be journaled never became visible: it leaves no trace, its id is free.
    reg.create_named("t", segments(family))
    reg.discard("t")
    assert not reg.knows("t")
    reg.create_named("t", segments(family))


def test_tombstones_are_bounded_oldest_forgotten_first(family: ModelFamily) -> None:
    reg = Registry(max_tombstones=2)
    for sid in "abc":
        reg.create_named(sid, segments(family))
        reg.forget(sid)
    assert reg.num_tombstones == 2
    assert [reg.is_tombstoned(s) for s in "abc"] == [False, True, True]
    with pytest.raises(SessionNotFoundError, match="session a not found"):  # forgotten: still a 404
        reg.require("a")
    # Restored tombstones (oldest first) evict exactly as the live ones would have.
    reg.restore_tombstone("d", "was deleted")
    assert [reg.is_tombstoned(s) for s in "bcd"] == [False, True, True]
    # A tombstone restored again becomes the newest, so the next eviction takes the other one.
    reg.restore_tombstone("c", "was deleted")
    reg.restore_tombstone("e", "was deleted")
    assert [reg.is_tombstoned(s) for s in "cde"] == [True, False, True]

    none_kept = Registry(max_tombstones=0)
    none_kept.create_named("z", segments(family))
    none_kept.forget("z")
    assert none_kept.num_tombstones == 0 and not none_kept.knows("z")
    with pytest.raises(ValueError):
        Registry(max_tombstones=-1)


def test_touch_all_marks_every_live_session_active(family: ModelFamily) -> None:
    reg = Registry()
    sessions = [reg.create(segments(family)) for _ in range(3)]
    for s in sessions:
        s.last_active = 0.0
    before = time.monotonic()
    reg.touch_all()
    assert all(s.last_active >= before for s in sessions)
