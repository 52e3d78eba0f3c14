"""session_server.sessions.session: the session record and the claim a turn holds on its slot.

A claim is the one channel between the owner of a turn and everyone else (DELETE, expiry, pause, shutdown): they ask
it to abort (the first reason wins, each listener hears it once) and the owner releases it. What the agent is told
comes from the reason; which engine-side books a turn uses comes from its segment (`lane`).
"""

from __future__ import annotations

from typing import Any

import pytest

from session_server.errors import AbortReason, SessionNotFoundError, SessionPausedError
from session_server.sessions.session import Claim, Session
from support.bounded import user
from trajectory import LinearTrajectory, ModelFamily, SegmentSet


def new_session(family: ModelFamily, sid: str = "s1") -> Session:
    return Session(id=sid, segments=SegmentSet(lambda: LinearTrajectory(family)), metadata={})


def claim_of(session: Session, released: list[Claim] | None = None, retry_after: int = 7) -> Claim:
    sink = released if released is not None else []
    claim = Claim(session, sink.append, retry_after)
    session.claims.add(claim)
    return claim


def test_the_first_abort_reason_wins_and_each_listener_hears_it_once(family: ModelFamily) -> None:
    claim = claim_of(new_session(family))
    heard: list[str] = []
    claim.on_abort(lambda: heard.append("a"))
    unsubscribe = claim.on_abort(lambda: heard.append("b"))
    claim.on_abort(lambda: heard.append("c"))
    unsubscribe()
    unsubscribe()  # twice: harmless
    assert heard == [] and claim.reason is None
    claim.abort(AbortReason.DELETE)
    claim.abort(AbortReason.PAUSE)  # too late: DELETE stays the reason, nobody is told again
    assert claim.reason is AbortReason.DELETE
    assert heard == ["a", "c"]
    # A listener that subscribes after the abort is called at once (it must not wait for an abort that came).
    late = claim.on_abort(lambda: heard.append("late"))
    assert heard == ["a", "c", "late"]
    late()  # its unsubscribe is a no-op


@pytest.mark.parametrize(("reason", "error", "status", "words"), [
    (AbortReason.DELETE, SessionNotFoundError, 404, "was deleted during the chat"),
    (AbortReason.EXPIRY, SessionNotFoundError, 404, "expired"),
    (AbortReason.PAUSE, SessionPausedError, 503, "server was paused; retry the same turn"),
    (AbortReason.SHUTDOWN, SessionPausedError, 503, "shutting down"),
])
def test_what_the_agent_hears_depends_on_why_its_chat_was_cut(
    family: ModelFamily, reason: AbortReason, error: type[Exception], status: int, words: str,
) -> None:
    claim = claim_of(new_session(family, "abc"), retry_after=7)
    assert claim.abort_error() is None
    claim.raise_if_aborted()  # not aborted: nothing raised
    claim.abort(reason)
    err: Any = claim.abort_error()
    assert type(err) is error and err.status == status and words in err.message
    assert err.abort_reason is reason  # counted under the reason it was cut for
    if status == 503:
        assert err.retry_after == 7  # the server's Retry-After, as the claim was given it
    else:
        assert "abc" in err.message
    with pytest.raises(error):
        claim.raise_if_aborted()


def test_a_turn_books_its_engine_side_under_its_segment(family: ModelFamily) -> None:
    """The first segment's lane is the session id (as a single-line session always had); any other segment's is its
    own, so an aborted request on one segment never holds back a turn of another."""
    claim = claim_of(new_session(family, "sid"))
    assert claim.lane == "sid"  # unbound yet
    claim.segment = 0
    assert claim.lane == "sid"
    claim.segment = 3
    assert claim.lane == "sid#3"


def test_busy_segments_lists_only_bound_claims_with_their_first_message(family: ModelFamily) -> None:
    session = new_session(family)
    assert session.trajectory is session.segments.main
    unbound = claim_of(session)
    assert session.busy_segments() == {}  # a claim whose request is not matched yet holds no segment
    plan = session.segments.prepare([user("hello")])
    unbound.segment, unbound.plan = plan.segment, plan
    assert session.busy_segments() == {0: user("hello")}


def test_release_goes_to_the_owner_of_the_slot_every_time(family: ModelFamily) -> None:
    """Claim.release hands itself to the releaser it was made with (the lifecycle, which makes it idempotent)."""
    released: list[Claim] = []
    claim = claim_of(new_session(family), released)
    claim.release()
    claim.release()
    assert released == [claim, claim]


def test_a_5xx_is_kept_as_the_sessions_failure_until_a_turn_commits(family: ModelFamily) -> None:
    """Infrastructure failures are not rewards (trajectory/infrastructure.py): the session keeps the latest 5xx a
    turn of it ended with, by its abort reason or else its code; a 4xx is the request's own; a commit clears it."""
    from session_server.errors import EngineAbortedError, EngineUnavailableError, tag_abort
    from support.tito import Reply, generate
    from trajectory.errors import RequestValidationError

    session = new_session(family)
    session.record_failure(RequestValidationError("bad max_tokens"))
    assert session.failure is None
    session.record_failure(EngineUnavailableError("engine unreachable"))
    failure = session.failure
    assert failure is not None and (failure.cause, failure.code, failure.status, failure.turns, failure.source) == (
        "engine_unavailable", "engine_unavailable", 502, 0, "server")
    session.record_failure(tag_abort(EngineAbortedError("past --max-staleness"), AbortReason.STALE))
    assert session.failure is not None and (session.failure.cause, session.failure.code) == ("stale",
                                                                                            "engine_aborted")
    traj = session.trajectory
    plan = traj.prepare([{"role": "user", "content": "q"}])
    traj.commit(plan, *generate(family, plan, Reply("a"), rid="r0"))
    assert session.failure is None  # the agent retried and went on
    session.record_failure(SessionPausedError("chat aborted: the server was paused", 1))
    assert session.failure is not None and session.failure.turns == 1
