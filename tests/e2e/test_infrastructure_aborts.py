"""Infrastructure failures are not rewards (issue 38 item 4): a session whose latest turn the infrastructure failed
gives samples that say so (status "aborted", `metadata["abort"]` with the recorded cause), and only then.

Against `sglang-sim`: a first turn commits, then the second fails -- the engine answers 5xx, resets the connection,
sends a malformed reply, the turn's deadline passes, a pause aborts it -- and the session's samples are collected.
The controls: a turn the request itself got wrong (a 4xx) leaves the samples completed, and so does a failed turn the
agent retried and went on from (the episode did not end there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from rollout import SessionClient
from rollout.episodes import Task, run_episodes
from rollout.tools import Tool, Toolbox
from sglang_sim.directives import tool_call
from support.server import assert_engine_baseline, chat_url, engine_info, new_session
from support.stack import Stack, StackFactory
from trajectory import infrastructure_abort, samples_from_json

TOKEN_MS = 5
LONG = 600  # tokens: 3 s at the engine; the pause comes once a few are out
DEADLINE_S = 1
FIRST = {"messages": [{"role": "user", "content": "first [[sim: tokens 6]]"}], "max_tokens": 16}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family="qwen3", sim_args=("--token-latency-ms", str(TOKEN_MS)),
                       servers={"server": [], "deadline": ["--request-timeout", str(DEADLINE_S)]}) as stack:
        yield stack


def _second(first: dict[str, Any], text: str, tokens: int = 16) -> dict[str, Any]:
    return {"messages": [*FIRST["messages"], first["choices"][0]["message"], {"role": "user", "content": text}],
            "max_tokens": tokens}


def _sim_fault(fault: str) -> Callable[[Stack, str, dict[str, Any]], httpx.Response]:
    def run(stack: Stack, url: str, body: dict[str, Any]) -> httpx.Response:
        httpx.post(f"{stack.engine}/sim/faults", json={fault: 1.0}, timeout=10).raise_for_status()
        try:
            return httpx.post(url, json=body, timeout=60)
        finally:
            httpx.post(f"{stack.engine}/sim/faults", json={}, timeout=10).raise_for_status()
    return run


def _pause_abort(stack: Stack, url: str, body: dict[str, Any]) -> httpx.Response:
    body = {**body, "messages": [*body["messages"][:-1], {"role": "user", "content": f"long [[sim: tokens {LONG}]]"}],
            "max_tokens": LONG}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, url, json=body, timeout=60)
        deadline = time.monotonic() + 30
        while engine_info(stack.engine)["output_tokens_in_flight"] < 10:
            assert time.monotonic() < deadline and not reply.done(), "the long reply never ran"
            time.sleep(0.005)
        try:
            assert httpx.post(f"{stack.server}/admin/pause", json={"mode": "abort"}, timeout=30).status_code == 200
        finally:
            assert httpx.post(f"{stack.server}/admin/continue", json={}, timeout=30).status_code == 200
        return reply.result()


def _deadline(stack: Stack, url: str, body: dict[str, Any]) -> httpx.Response:
    long = {**body, "messages": [*body["messages"][:-1], {"role": "user", "content": "long [[sim: tokens 4000]]"}],
            "max_tokens": 4000}
    return httpx.post(url, json=long, timeout=60)


# fault -> (server, how the second turn fails, its status, the recorded cause)
FAULTS: dict[str, tuple[str, Callable[[Stack, str, dict[str, Any]], httpx.Response], int, str]] = {
    "engine_5xx": ("server", _sim_fault("http_500"), 500, "engine_refused"),
    "connection_reset": ("server", _sim_fault("drop_connection"), 502, "engine_unavailable"),
    "malformed_reply": ("server", _sim_fault("malformed_json"), 502, "upstream_error"),
    "deadline": ("deadline", _deadline, 504, "timeout"),
    "pause_abort": ("server", _pause_abort, 503, "pause"),
}


def _samples(server: str, sid: str) -> list[Any]:
    r = httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=30)
    assert r.status_code == 200, r.text
    return samples_from_json(r.json())


def _first_turn(server: str) -> tuple[str, dict[str, Any]]:
    sid = new_session(server)
    first = httpx.post(chat_url(server, sid), json=FIRST, timeout=60)
    assert first.status_code == 200, first.text
    return sid, first.json()


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_session_the_infrastructure_failed_gives_aborted_samples(stack: Stack, name: str) -> None:
    where, fail, status, cause = FAULTS[name]
    server = stack[where]
    sid, first = _first_turn(server)
    assert [s.status for s in _samples(server, sid)] == ["completed"]
    reply = fail(stack, chat_url(server, sid), _second(first, "second [[sim: tokens 6]]"))
    assert reply.status_code == status, reply.text
    (sample,) = _samples(server, sid)
    assert sample.status == "aborted"
    abort = infrastructure_abort(sample)
    assert abort is not None and (abort.cause, abort.status, abort.turns, abort.source) == (cause, status, 1, "server")
    assert sample.metadata["num_turns"] == 1  # nothing of the failed turn was committed

    # the agent retries and goes on: the episode did not end there
    again = httpx.post(chat_url(server, sid), json=_second(first, "second [[sim: tokens 6]]"), timeout=60)
    assert again.status_code == 200, again.text
    (sample,) = _samples(server, sid)
    assert (sample.status, "abort" in sample.metadata) == ("completed", False)
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204
    assert_engine_baseline(stack.engine)


def test_a_turn_the_request_got_wrong_is_not_an_infrastructure_failure(stack: Stack) -> None:
    sid, first = _first_turn(stack.server)
    bad = {**_second(first, "second"), "max_tokens": -1}
    reply = httpx.post(chat_url(stack.server, sid), json=bad, timeout=60)
    assert reply.status_code == 400, reply.text
    (sample,) = _samples(stack.server, sid)
    assert (sample.status, "abort" in sample.metadata) == ("completed", False)
    assert httpx.delete(f"{stack.server}/sessions/{sid}", timeout=30).status_code == 204


def test_a_streamed_turn_the_deadline_ended_is_recorded_too(stack: Stack) -> None:
    server = stack["deadline"]
    sid, first = _first_turn(server)
    long = _second(first, "long [[sim: tokens 4000]]", 4000)
    with httpx.stream("POST", chat_url(server, sid), json={**long, "stream": True}, timeout=60) as r:
        r.read()
    (sample,) = _samples(server, sid)
    abort = infrastructure_abort(sample)
    assert sample.status == "aborted" and abort is not None and abort.cause == "timeout", sample.metadata
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


def test_run_episodes_keeps_the_samples_of_an_episode_the_engine_failed(stack: Stack) -> None:
    """rollout.run_episodes: a tool episode whose second turn the engine answers 500 fails (error set), and still
    hands over the session's samples, marked by the server's record, for the trainer to drop."""
    def breaks_the_engine(args: dict[str, Any]) -> str:
        httpx.post(f"{stack.engine}/sim/faults", json={"http_500": 1.0}, timeout=10).raise_for_status()
        return "ok"

    toolbox = Toolbox([Tool("run", "runs a command", {"type": "object"}, breaks_the_engine)])
    task = Task([{"role": "user", "content": f"go {tool_call('run', cmd='ls')}"}], toolbox)

    async def main() -> Any:
        async with SessionClient(stack.server) as client:
            return await run_episodes(client, [task])

    try:
        (result,) = asyncio.run(main())
    finally:
        httpx.post(f"{stack.engine}/sim/faults", json={}, timeout=10).raise_for_status()
    assert result.error is not None and "500" in result.error and result.turns == 1
    (sample,) = result.samples
    abort = infrastructure_abort(sample)
    assert sample.status == "aborted" and abort is not None
    assert (abort.cause, abort.status, abort.turns, abort.source) == ("engine_refused", 500, 1, "server")
