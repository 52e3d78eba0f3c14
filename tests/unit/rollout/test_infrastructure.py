"""rollout.infrastructure: which exceptions of an agent report an infrastructure failure, and the samples collected
after one (marked, the server's own record kept)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from rollout.errors import ServerConnectionError, SessionServerError
from rollout.infrastructure import collect_after_failure, infrastructure_failure
from trajectory import InfrastructureAbort, Sample, abort_samples, infrastructure_abort

REQUEST = httpx.Request("POST", "http://server/sessions/s1/v1/chat/completions")


def _status_error(status: int, code: str) -> openai.APIStatusError:
    body = {"error": {"message": "m", "type": code, "code": code}}
    return openai.APIStatusError("m", response=httpx.Response(status, json=body, request=REQUEST), body=body)


def test_a_5xx_or_a_lost_connection_is_the_infrastructures_and_a_4xx_is_not() -> None:
    timeout = infrastructure_failure(_status_error(504, "engine_timeout"))
    assert timeout is not None and (timeout.cause, timeout.status, timeout.source) == ("engine_timeout", 504, "client")
    gone = infrastructure_failure(openai.APIConnectionError(request=REQUEST))
    assert gone is not None and (gone.cause, gone.status) == ("connection", None)
    assert infrastructure_failure(openai.APITimeoutError(request=REQUEST)).cause == "timeout"  # type: ignore[union-attr]
    assert infrastructure_failure(httpx.ConnectError("refused")).cause == "connection"  # type: ignore[union-attr]
    assert infrastructure_failure(ServerConnectionError("POST", "u", OSError("x"))).cause == "connection"  # type: ignore[union-attr]
    paused = infrastructure_failure(SessionServerError("POST", "u", 503, {"error": {"code": "session_paused"}}))
    assert paused is not None and (paused.cause, paused.status) == ("session_paused", 503)
    assert infrastructure_failure(_status_error(400, "invalid_request")) is None
    assert infrastructure_failure(SessionServerError("POST", "u", 404, {})) is None
    assert infrastructure_failure(ValueError("a bug in a tool")) is None


def test_a_failure_wrapped_by_the_agent_is_found_in_its_causes() -> None:
    try:
        try:
            raise openai.APIConnectionError(request=REQUEST)
        except openai.APIConnectionError as exc:
            raise RuntimeError("my agent failed") from exc
    except RuntimeError as wrapped:
        found = infrastructure_failure(wrapped)
    assert found is not None and found.cause == "connection"


def _sample(turns: int) -> Sample:
    mask = np.array([0, 1, 1], dtype=np.uint8)
    return Sample(np.arange(3, dtype=np.int32), mask, np.where(mask == 1, -0.5, 0.0).astype(np.float32), 2,
                  "completed", {"num_turns": turns})


class FakeClient:
    def __init__(self, samples: list[Sample] | Exception) -> None:
        self.samples = samples
        self.collected = 0

    async def collect(self, session_id: str, max_seq_len: int | None = None, format: str = "safetensors") -> Any:
        self.collected += 1
        if isinstance(self.samples, Exception):
            raise self.samples
        return self.samples


def _collect(client: FakeClient, exc: BaseException) -> list[Sample] | None:
    return asyncio.run(collect_after_failure(client, "s1", exc))  # type: ignore[arg-type]


def test_the_samples_after_an_infrastructure_failure_are_marked() -> None:
    client = FakeClient([_sample(2), _sample(1)])
    out = _collect(client, _status_error(502, "engine_unavailable"))
    assert out is not None and [s.status for s in out] == ["aborted", "aborted"]
    abort = infrastructure_abort(out[0])
    assert abort is not None and (abort.cause, abort.turns, abort.source) == ("engine_unavailable", 3, "client")


def test_the_servers_own_record_is_kept() -> None:
    server = InfrastructureAbort("timeout", "engine_timeout", 504, "deadline", 1, "server")
    client = FakeClient(abort_samples([_sample(1)], server))
    (sample,) = _collect(client, openai.APIConnectionError(request=REQUEST)) or []
    assert infrastructure_abort(sample) == server


@pytest.mark.parametrize("exc", [ValueError("a tool's bug"), _status_error(400, "invalid_request")])
def test_nothing_is_collected_for_the_agents_own_failure(exc: BaseException) -> None:
    client = FakeClient([_sample(1)])
    assert _collect(client, exc) is None and client.collected == 0


def test_samples_that_cannot_be_had_are_none() -> None:
    client = FakeClient(ServerConnectionError("POST", "u", OSError("still down")))
    assert _collect(client, openai.APIConnectionError(request=REQUEST)) is None
