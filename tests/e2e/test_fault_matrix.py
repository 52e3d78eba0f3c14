"""Every fault, through every API, plain and streamed: the same outcome in both modes (issue 31).

A plain and a streamed turn are two ways of consuming one engine call (session_server/turns/engine_call.py), so
whatever breaks -- the engine lost its session, answered 5xx, reset the connection mid-reply, sent a malformed reply
or a NaN logprob, aborted everything for a weight update; the operator paused (abort or in place); the client went
away; the deadline passed; the session was deleted mid-turn -- the agent of either mode must see the same thing (the
status, or for a stream that already began the same error in its error event; the same reply text), the session
must hold the same turns, and the engine must hold the same afterwards (its sessions; no request left running; after
the DELETE, nothing at all).

Against `sglang-sim` with --engine-sessions, so the engine session's books are part of every outcome (a first turn
opens none: each case's turn comes after a committed one, so it opens and runs in one). Replies that
must still run when a fault is injected are long by construction (LONG tokens at TOKEN_MS each, the fault injected
once the engine has emitted a few of them); the deadline's reply is twenty times the deadline. One stack per module;
each case runs its two modes one after the other and compares them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from harness.launchers import start_sim
from support.server import (
    assert_engine_baseline,
    engine_info,
    metric,
    new_session,
    wait_engine_idle,
    wait_engine_sessions,
)
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
TOKEN_MS = 5
LONG = 600  # tokens: 3 s at the engine, the fault comes after EMITTED of them
EMITTED = 10
DEADLINE_S = 1
DEADLINE_TOKENS = 4000  # 20 s at the engine: twenty times the deadline
SIM_ARGS = ("--enable-streaming-session", "--token-latency-ms", str(TOKEN_MS))
SESSIONS = ["--engine-sessions", "--engine-stream-interval", "8"]
APIS = ("chat", "responses", "messages")
PATHS = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}
REOPENS = "session_server_engine_session_reopens_total"
DISCONNECTS = 'session_server_aborts_total{cause="disconnect"}'


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY, sim_args=SIM_ARGS, proxied={"gone"},
        servers={"server": SESSIONS, "gone": SESSIONS,
                 "deadline": [*SESSIONS, "--request-timeout", str(DEADLINE_S)]},
    ) as stack:
        yield stack


# -- the three APIs, as an agent speaks them ------------------------------------------------------------------------

def _body(api: str, text: str, tokens: int, stream: bool, before: Sequence[tuple[str, Any]] = ()) -> dict[str, Any]:
    """One turn's request; `before`: the previous turns (each its user text and the reply as the API returned it)."""
    user = {"role": "user", "content": text}
    if api == "chat":
        history = [m for t, r in before for m in ({"role": "user", "content": t}, r["choices"][0]["message"])]
        return {"messages": [*history, user], "max_tokens": tokens, "stream": stream}
    if api == "responses":
        chained = {} if not before else {"previous_response_id": before[-1][1]["id"]}
        return {"model": "m", "input": text, "max_output_tokens": tokens, "stream": stream, **chained}
    history = [m for t, r in before for m in ({"role": "user", "content": t},
                                              {"role": "assistant", "content": r["content"]})]
    return {"model": "m", "messages": [*history, user], "max_tokens": tokens, "stream": stream}


def _plain_text(api: str, obj: dict[str, Any]) -> str:
    if api == "chat":
        return str(obj["choices"][0]["message"]["content"])
    if api == "responses":
        return "".join(part["text"] for item in obj["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
    return "".join(block["text"] for block in obj["content"] if block["type"] == "text")


def _error_kind(api: str, error: Any) -> str:
    """What an error is called in the API's own shape (the same in an error reply and in a stream's error event);
    the engine's own error, which Chat Completions passes on as it came, by its message."""
    assert isinstance(error, dict), error
    return str(error["code"] if api == "responses" else error.get("type") or error["message"])


def _stream_read(api: str, events: list[Any]) -> tuple[str, str | None]:
    """The text a stream delivered, and the error its error event named (None: it ended well)."""
    text, error = [], None
    for event in events:
        if api == "chat":
            if "error" in event:
                error = _error_kind(api, event["error"])
            elif event.get("choices"):
                text.append(event["choices"][0]["delta"].get("content") or "")
        elif api == "responses":
            if event["type"] == "response.failed":
                error = _error_kind(api, event["response"]["error"])
            elif event["type"] == "response.output_text.delta":
                text.append(event["delta"])
        elif event["type"] == "error":
            error = _error_kind(api, event["error"])
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text.append(event["delta"]["text"])
    return "".join(text), error


@dataclass(frozen=True)
class Seen:
    """What the agent saw: the HTTP status (None for a stream that began and then failed, which is always 200, or
    for a client that left), the outcome's name ("ok", the API's name of the error, "gone") and the reply text."""

    status: int | None
    kind: str
    text: str | None


def _events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body, named events (`event: X` then `data: {...}`) included, `[DONE]` left out."""
    return [json.loads(line[5:]) for block in body.split(b"\n\n") for line in block.split(b"\n")
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]


def _seen(api: str, status: int, body: bytes, streamed: bool) -> Seen:
    if streamed and status == 200:
        text, error = _stream_read(api, _events(body))
        return Seen(None, error, None) if error is not None else Seen(200, "ok", text)
    obj = json.loads(body)
    if status != 200:
        return Seen(status, _error_kind(api, obj.get("error", obj)), None)
    return Seen(200, "ok", _plain_text(api, obj))


@dataclass(frozen=True)
class Outcome:
    seen: Seen
    committed: list[Any] | None  # the session's committed messages (None: the session is gone)
    engine_sessions: int  # what the engine holds afterwards, once it runs nothing
    counted: float  # the metric the case watches, as it moved during the turn


# -- one turn under a fault -----------------------------------------------------------------------------------------

@dataclass
class Turn:
    stack: Stack
    api: str
    streamed: bool
    server: str
    sid: str
    before: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"{self.server}/sessions/{self.sid}/v1/{PATHS[self.api]}"

    def body(self, text: str, tokens: int) -> dict[str, Any]:
        return _body(self.api, text, tokens, self.streamed, self.before)

    def post(self, text: str = "short [[sim: tokens 8]]", tokens: int = 64) -> tuple[int, bytes]:
        with httpx.stream("POST", self.url, json=self.body(text, tokens), timeout=60) as r:
            return r.status_code, r.read()

    def post_while(self, act: Callable[[], None], tokens: int = LONG) -> tuple[int, bytes]:
        """A long turn, with `act` run once the engine has emitted EMITTED of its tokens."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(self.post, f"long [[sim: tokens {tokens}]]", tokens)
            _wait(lambda: engine_info(self.stack.engine)["output_tokens_in_flight"] >= EMITTED or reply.done(),
                  "the engine emitted some tokens")
            assert not reply.done(), reply.result()
            act()
            return reply.result()


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def _restart_engine(stack: Stack) -> None:
    """The engine restarted between two turns: every engine session it held is gone."""
    old = stack.procs[0]
    old.stop()
    stack.procs[0] = start_sim(stack.tok, FAMILY, *SIM_ARGS, "--port", str(old.port), log_dir=stack.logs)


def _close_engine_session(stack: Stack) -> None:
    """The engine closed the session behind the server's back (its idle timeout): what a restart loses."""
    assert stack.proxy is not None
    engine_sid = [c for c in stack.proxy.calls if c["path"] == "/open_session"][-1]["response"]
    assert httpx.post(f"{stack.engine}/close_session", json={"session_id": engine_sid}).status_code == 200


def _sim_fault(stack: Stack, fault: str) -> Callable[[Turn], tuple[int, bytes]]:
    def run(turn: Turn) -> tuple[int, bytes]:
        httpx.post(f"{stack.engine}/sim/faults", json={fault: 1.0}, timeout=10).raise_for_status()
        try:
            return turn.post()
        finally:
            httpx.post(f"{stack.engine}/sim/faults", json={}, timeout=10).raise_for_status()
    return run


def _hang_up(turn: Turn) -> tuple[int, bytes]:
    """The client goes away mid-turn (plain: while the engine runs it; streamed: with the stream open)."""
    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            request = asyncio.ensure_future(http.post(turn.url, json=turn.body(f"long [[sim: tokens {LONG}]]", LONG)))
            while engine_info(turn.stack.engine)["output_tokens_in_flight"] < EMITTED:
                assert not request.done(), request.result().text
                await asyncio.sleep(0.005)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(main())
    return 0, b""


def _post_control(url: str, body: dict[str, Any]) -> None:
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 200, r.text


@dataclass(frozen=True)
class Fault:
    """How to run the turn under the fault, the status a plain turn gets, and the metric that must move by one in
    each mode ("" for none)."""

    run: Callable[[Stack, Turn], tuple[int, bytes]]
    status: int | None
    counts: str = ""
    server: str = "server"
    # Turns committed before the one under the fault. The first opens no engine session (nothing to reuse), the
    # second opens one: by default the fault meets a turn running in the engine session it opened, and the faults
    # that take an engine session away come after two.
    setup_turns: int = 1
    reset: Callable[[Stack], None] | None = None


def _weight_update(stack: Stack, turn: Turn) -> tuple[int, bytes]:
    return turn.post_while(lambda: _post_control(f"{stack.engine}/update_weight_version", {"new_version": "next"}))


def _back_to_default_weights(stack: Stack) -> None:
    _post_control(f"{stack.engine}/update_weight_version", {"new_version": "default", "abort_all_requests": False})
    for server in stack.servers.values():  # a continue asks the engine which weights it serves (engine/versions.py)
        _post_control(f"{server}/admin/continue", {})


def _pause(mode: str) -> Callable[[Stack, Turn], tuple[int, bytes]]:
    def run(stack: Stack, turn: Turn) -> tuple[int, bytes]:
        def act() -> None:
            _post_control(f"{stack.server}/admin/pause", {"mode": mode})
            if mode == "in_place":  # the reply waits in the paused engine until the trainer continues
                _post_control(f"{stack.server}/admin/continue", {})
        try:
            return turn.post_while(act)
        finally:
            _post_control(f"{stack.server}/admin/continue", {})
    return run


FAULTS: dict[str, Fault] = {
    "engine_restarted": Fault(lambda s, t: (_restart_engine(s), t.post())[1], 200, REOPENS, "gone", 2),
    "engine_session_closed": Fault(lambda s, t: (_close_engine_session(s), t.post())[1], 200, REOPENS, "gone", 2),
    "engine_5xx": Fault(lambda s, t: _sim_fault(s, "http_500")(t), 500),
    "connection_reset": Fault(lambda s, t: _sim_fault(s, "drop_connection")(t), 502),
    "malformed_reply": Fault(lambda s, t: _sim_fault(s, "malformed_json")(t), 502,
                             'session_server_engine_validation_failures_total{rule="json"}'),
    "nan_logprob": Fault(lambda s, t: _sim_fault(s, "nan_logprob")(t), 502),
    "weight_update": Fault(_weight_update, 200, 'session_server_turn_continuations_total{result="continued"}',
                           reset=_back_to_default_weights),
    "pause_abort": Fault(_pause("abort"), 503, 'session_server_aborts_total{cause="pause"}'),
    "pause_in_place": Fault(_pause("in_place"), 200),
    "client_disconnect": Fault(lambda s, t: _hang_up(t), None, DISCONNECTS),
    "deadline": Fault(lambda s, t: t.post(f"long [[sim: tokens {DEADLINE_TOKENS}]]", DEADLINE_TOKENS), 504,
                      'session_server_aborts_total{cause="timeout"}', "deadline"),
    "delete_mid_turn": Fault(
        lambda s, t: t.post_while(lambda: httpx.delete(f"{t.server}/sessions/{t.sid}", timeout=30).raise_for_status()),
        404, 'session_server_aborts_total{cause="delete"}'),
}


def _committed(server: str, sid: str) -> list[Any] | None:
    r = httpx.get(f"{server}/sessions/{sid}", timeout=10)
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    return [record["message"] for record in r.json()["records"]]


def _outcome(stack: Stack, name: str, api: str, streamed: bool) -> Outcome:
    fault = FAULTS[name]
    server = stack[fault.server]
    sid = new_session(server)
    turn = Turn(stack, api, streamed, server, sid)
    for k in range(fault.setup_turns):
        text = f"setup {k} [[sim: tokens 6]]"
        status, body = Turn(stack, api, False, server, sid, list(turn.before)).post(text)
        assert status == 200, body
        turn.before.append((text, json.loads(body)))
    counted = metric(server, fault.counts, 0.0) if fault.counts else 0.0
    try:
        try:
            status, body = fault.run(stack, turn)
        finally:
            if fault.reset is not None:
                fault.reset(stack)
        seen = Seen(None, "gone", None) if status == 0 else _seen(api, status, body, streamed)
        if fault.counts:  # a client's disconnect is counted once the server sees it, a moment after it left
            with contextlib.suppress(AssertionError):
                _wait(lambda: metric(server, fault.counts, 0.0) > counted, f"{fault.counts} counted", timeout=10)
            counted = metric(server, fault.counts, 0.0) - counted
        # A DELETE closes its engine session in the background: the count is read once no close is under way.
        _wait(lambda: metric(server, "session_server_engine_session_closes_under_way", 0.0) == 0, "closes landed",
              timeout=30)
        idle = wait_engine_idle(stack.engine, timeout=30)
        return Outcome(seen, _committed(server, sid), idle["open_sessions"], counted)
    finally:  # whatever happened, the next case starts from an engine that holds nothing
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code in (204, 404)
        wait_engine_sessions(stack.engine, 0)  # the DELETE's close lands in the background
        assert_engine_baseline(stack.engine)


# The engine restart costs a sim start: once, through Chat Completions; what it loses (the engine sessions) is what
# engine_session_closed takes away through every API.
CASES = [(name, api) for name in FAULTS for api in APIS if name != "engine_restarted" or api == "chat"]


@pytest.mark.parametrize(("name", "api"), CASES)
def test_a_fault_ends_a_plain_and_a_streamed_turn_alike(stack: Stack, name: str, api: str) -> None:
    fault = FAULTS[name]
    plain = _outcome(stack, name, api, streamed=False)
    streamed = _outcome(stack, name, api, streamed=True)
    expected = fault.status if not (api == "messages" and fault.status == 503) else 529  # Anthropic's overloaded
    assert plain.seen.status == expected, plain
    # A stream that failed after its first byte says so in its error event (status None), under the same name.
    assert streamed.seen.status in (expected, None) if expected != 200 else streamed.seen.status == 200, streamed
    assert (streamed.seen.kind, streamed.seen.text) == (plain.seen.kind, plain.seen.text)
    assert streamed.committed == plain.committed
    assert streamed.engine_sessions == plain.engine_sessions
    assert streamed.counted == plain.counted == (1 if fault.counts else 0)
    if expected == 200:
        assert plain.committed is not None and len(plain.committed) == 1 + fault.setup_turns
        assert plain.committed[-1]["content"] == plain.seen.text
    elif plain.committed is not None:
        assert len(plain.committed) == fault.setup_turns  # nothing of the failed turn
