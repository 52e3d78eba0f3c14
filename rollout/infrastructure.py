"""The agent's side of "infrastructure failures are not rewards" (trajectory/infrastructure.py).

The server records the 5xx it answers a turn with, and its samples say so. What it cannot record, the agent's side
sees: a connection refused or broken (the server restarted or died), a 5xx the agent gave up on after its retries.
`infrastructure_failure` reads that off the exception an agent raised (following its causes: agents wrap errors),
and `collect_after_failure` collects the session's samples marked with it, so a failed episode reaches the trainer
as samples to drop rather than as an exception or a fake zero reward. Any other exception (a 4xx: the agent's own
request; a bug in a tool) is not the infrastructure's, and is left to propagate.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai

from rollout.client import SampleFormat, SessionClient
from rollout.errors import RolloutError, ServerConnectionError, SessionServerError
from trajectory import InfrastructureAbort, Sample, abort_samples
from trajectory.infrastructure import is_infrastructure_status


class EpisodeAbortedError(RolloutError):
    """An episode the infrastructure ended, raised where the trainer's seam drops a failed rollout by an exception
    (verl's TransferQueue worker marks the prompt's group "failure" and its replay buffer evicts it)."""

    def __init__(self, session_id: str | None, abort: InfrastructureAbort | None) -> None:
        what = "an infrastructure failure" if abort is None else f"{abort.cause} ({abort.code}: {abort.message})"
        who = "the episode" if session_id is None else f"session {session_id}"
        super().__init__(f"{who} was ended by {what}: its samples are not scored")
        self.session_id = session_id
        self.abort = abort


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _error_code(body: object) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        return str(code) if code else None
    return None


def infrastructure_failure(exc: BaseException) -> InfrastructureAbort | None:
    """The infrastructure failure `exc` (or an exception it was raised from) reports, None if it reports none.
    `turns` is 0 here: `collect_after_failure` fills in what the samples hold."""
    for err in _causes(exc):
        if isinstance(err, openai.APITimeoutError):
            return _client("timeout", err, None)
        if isinstance(err, (openai.APIConnectionError, httpx.TransportError, ServerConnectionError)):
            return _client("connection", err, None)
        if isinstance(err, openai.APIStatusError) and is_infrastructure_status(err.status_code):
            body = err.body  # the whole body, or (older clients) its "error" object
            code = _error_code(body if isinstance(body, dict) and "error" in body else {"error": body})
            return _client(code or f"http_{err.status_code}", err, err.status_code)
        if isinstance(err, SessionServerError) and is_infrastructure_status(err.status):
            return _client(_error_code(err.body) or f"http_{err.status}", err, err.status)
    return None


def _client(cause: str, err: BaseException, status: int | None) -> InfrastructureAbort:
    return InfrastructureAbort(cause=cause, code=type(err).__name__, status=status, message=str(err)[:500], turns=0,
                               source="client")


async def collect_after_failure(client: SessionClient, session_id: str, exc: BaseException,
                                max_seq_len: int | None = None,
                                format: SampleFormat = "safetensors") -> list[Sample] | None:
    """The session's samples after the agent failed with `exc`, marked as ended by the infrastructure (the server's
    own record kept where it has one); None if `exc` is not the infrastructure's, or the samples cannot be had
    (the server is still gone)."""
    failure = infrastructure_failure(exc)
    if failure is None:
        return None
    try:
        samples = await client.collect(session_id, max_seq_len, format)
    except RolloutError:
        return None
    turns = sum(int(s.metadata.get("num_turns", 0)) for s in samples)
    return abort_samples(samples, InfrastructureAbort(failure.cause, failure.code, failure.status, failure.message,
                                                      turns, failure.source))
