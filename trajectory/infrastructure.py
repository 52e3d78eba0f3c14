"""Infrastructure failures are not rewards: the fact that an episode ended because the infrastructure failed it.

An episode whose engine died, whose turn hit the server's deadline, that a pause, a shutdown or the staleness bound cut
off, or whose server went away, did not end by anything the model did: a trainer that scores it zero (the agent's
usual answer to an exception) biases its group's advantages (open-instruct #1887: spot preemption's fake zeros). Its
samples say so instead: status `aborted` (which nothing else sets: the server never commits a reply the engine
aborted) and `metadata["abort"]`, this record, so a trainer can drop them (rollout/adapters map it to each trainer's
field for a dropped or masked sample).

Who knows it, from facts recorded, never guessed:
- the server, for a turn it answered with a 5xx (the failure is the server's or the engine's, not the request's): it
  records the error on the session, and the session's samples carry it until a later turn commits (the agent retried
  and went on: the episode did not end there). `source` "server". Kept in memory, not in the journal: a restart is
  seen by the agent's side, as a lost connection.
- the agent's side, for what the server cannot record (a connection refused or broken, e.g. a server restart; a 5xx
  the agent gave up on): rollout's runners mark the samples they still collect. `source` "client".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .samples import Sample

ABORTED = "aborted"  # the sample status an infrastructure failure gives


@dataclass(frozen=True, slots=True)
class InfrastructureAbort:
    """How an episode was failed by the infrastructure (the `abort` key of its samples' metadata)."""

    cause: str  # what failed: engine_unavailable, timeout, engine, stale, pause, shutdown, connection, ...
    code: str  # the error code the agent was answered with (or the client's exception type)
    status: int | None  # its HTTP status, None where no answer came
    message: str
    turns: int  # the turns the session had committed when it failed: the failed turn was the next one
    source: str  # "server" (recorded by the session server) or "client" (seen by the agent's side)

    def info(self) -> dict[str, Any]:
        return {"cause": self.cause, "code": self.code, "status": self.status, "message": self.message,
                "turns": self.turns, "source": self.source}

    @classmethod
    def from_info(cls, raw: dict[str, Any]) -> InfrastructureAbort:
        status = raw.get("status")
        return cls(cause=str(raw["cause"]), code=str(raw["code"]), status=None if status is None else int(status),
                   message=str(raw.get("message", "")), turns=int(raw.get("turns", 0)), source=str(raw["source"]))


def is_infrastructure_status(status: int) -> bool:
    """An HTTP answer that says the infrastructure failed the turn: a 5xx (a 4xx is the request's own fault)."""
    return 500 <= status < 600


def abort_samples(samples: Sequence[Sample], abort: InfrastructureAbort) -> list[Sample]:
    """Copies of `samples` marked as ended by `abort`; a sample already marked keeps its first (earlier) record."""
    out = []
    for sample in samples:
        if sample.status == ABORTED and "abort" in sample.metadata:
            out.append(sample)
        else:
            out.append(replace(sample, status=ABORTED, metadata={**sample.metadata, "abort": abort.info()}))
    return out


def infrastructure_abort(sample: Sample) -> InfrastructureAbort | None:
    """The record of the failure that ended `sample`'s episode, None if the infrastructure did not end it."""
    raw = sample.metadata.get("abort")
    if sample.status != ABORTED or not isinstance(raw, dict):
        return None
    return InfrastructureAbort.from_info(raw)
