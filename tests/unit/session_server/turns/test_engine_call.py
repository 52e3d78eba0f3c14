"""session_server.turns.engine_call: the one engine call behind a plain and a streamed turn.

The engine here is a script of replies (what SGLang 0.5.23 answers, byte for byte where it matters); everything else
is the real thing: the family and its tokenizer, the TITO plan, the strict decode, the race, the metrics. What is
checked is what the two modes must share: a lost engine session is reopened and the turn resent once (a plain
request gets SGLang's 400; a streamed one either an error event or, as SGLang 0.5.23 sends it, a final event whose
abort carries the status), any other refusal reaches the agent, and the deadline ends both with one text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from session_server.chat.serving import CHAT
from session_server.config import ServerConfig
from session_server.engine.client import EngineReply
from session_server.engine.sessions import engine_session_gone
from session_server.engine.sse import Progress
from session_server.engine.versions import cache_key
from session_server.errors import AbortReason, EngineRefusedError, EngineTimeoutError
from session_server.metrics import Metrics
from session_server.sessions.session import Claim
from session_server.turns.engine_call import EngineCall, refused_in_stream
from session_server.turns.turn import Turn
from support import virtual_time
from trajectory import LinearTrajectory, ModelFamily
from trajectory.errors import SessionError

GONE = "Invalid request: session id s-1 does not exist"
REFUSED_PLAIN = (400, json.dumps({"error": {"message": GONE}}).encode())  # http_server.py generate_request
# The same refusal of a streamed request: the final event of tokenizer_manager.py `_handle_abort_finish_reason`.
REFUSED_STREAMED = {"text": "", "output_ids": [], "meta_info": {
    "id": "r", "finish_reason": {"type": "abort", "message": GONE, "status_code": 400, "err_type": "BadRequestError"},
    "prompt_tokens": 5, "completion_tokens": 0, "cached_tokens": 0}}
ERROR_EVENT = {"error": {"message": GONE, "type": "invalid_request_error", "code": 400, "retryable": False}}


def _reply(family: ModelFamily, text: str = "Hello there.") -> dict[str, Any]:
    ids = family.tokenizer.encode(text, add_special_tokens=False)
    return {"text": text, "output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": len(ids)}, "prompt_tokens": 5,
        "completion_tokens": len(ids), "cached_tokens": 0, "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class _Stream:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self._body = status, body
        self.headers = {"content-type": "text/event-stream" if status == 200 else "application/json"}

    async def aread(self) -> bytes:
        return self._body

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        yield self._body


@dataclass
class _Engine:
    """Answers each /generate with the next scripted (status, body); None: never answers."""

    script: list[tuple[int, bytes] | None]
    sent: list[bytes] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    async def _next(self, payload: bytes) -> tuple[int, bytes]:
        self.sent.append(payload)
        answer = self.script.pop(0)
        if answer is None:
            await asyncio.Event().wait()
        assert answer is not None
        return answer

    async def generate(self, payload: bytes, routing_key: str) -> EngineReply:
        status, body = await self._next(payload)
        return EngineReply(status, body, "application/json")

    @contextlib.asynccontextmanager
    async def stream_generate(self, payload: bytes, routing_key: str) -> AsyncIterator[_Stream]:
        yield _Stream(*await self._next(payload))

    async def abort(self, rid: str, routing_key: str | None = None) -> None:
        self.aborted.append(rid)

    def version_of(self, routing_key: str) -> str:
        return "default"

    def learn_version(self, routing_key: str, version: str) -> bool:
        return False

    def cache_key_of(self, routing_key: str, version: str) -> str:
        return cache_key(version)

    def distrust_key(self, routing_key: str, version: str, key: str) -> None:
        return None

    async def refresh_version(self, routing_key: str) -> None:
        return None


@dataclass
class _EngineSessions:
    """The books of engine sessions as the engine call drives them: a new engine session per open."""

    opened: int = 0
    forgotten: int = 0
    dirty: int = 0
    committed: list[int] = field(default_factory=list)

    async def begin_turn(self, session_id: str, new_token_start: int, remaining: float,
                         on_abort: Any = None) -> tuple[int, dict[str, Any]]:
        self.opened += 1
        return 0, {"id": f"s-{self.opened}"}

    def forget(self, session_id: str) -> None:
        self.forgotten += 1

    def mark_dirty(self, session_id: str) -> None:
        self.dirty += 1


class _Pool:
    inline_below_bytes = 1 << 30

    async def run_sized(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    run_decode = run_sized


class _Listener:
    logprobs = False

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def progress(self, progress: Progress) -> None:
        self.texts.append(progress.text)

    async def resumed(self, before: Any) -> None:
        raise AssertionError("no continuation here")


def _call(family: ModelFamily, engine: _Engine, sessions: _EngineSessions | None, stream: bool,
          timeout: float = 30.0) -> tuple[EngineCall[Any], Metrics]:
    config = ServerConfig(engine_url="http://engine", tokenizer="unused", model_family="qwen3",
                          request_timeout=timeout)
    metrics = Metrics()
    server = SimpleNamespace(config=config, engine=engine, engine_sessions=sessions, drains=None, pool=_Pool(),
                             metrics=metrics, family=family, prompt_token_limit=None,
                             lifecycle=SimpleNamespace(pause=SimpleNamespace(in_place=False, cut_replies=True)))
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": stream}).encode()
    trajectory = LinearTrajectory(family)
    request = CHAT.parse(body, trajectory)
    plan = trajectory.prepare(request.messages, request.tools, request.template_kwargs)
    claim = Claim(SimpleNamespace(id="sess"), lambda c: None, 1)  # type: ignore[arg-type]
    turn = Turn(request, plan, "r" * 32, "m", family)
    return EngineCall(server, claim, turn, CHAT), metrics  # type: ignore[arg-type]


def _never(callback: Callable[[], None]) -> Callable[[], None]:
    """A client that never leaves."""
    return lambda: None


def _reopens(metrics: Metrics) -> float:
    return float(metrics.engine_session_reopens._value.get())


@pytest.mark.parametrize("refusal", ["plain", "error_event", "abort_event"])
def test_a_lost_engine_session_is_reopened_and_the_turn_resent_once(families: dict[str, ModelFamily],
                                                                    refusal: str) -> None:
    family = families["qwen3"]
    reply = _reply(family)
    stream = refusal != "plain"
    first = {"plain": REFUSED_PLAIN, "error_event": (200, _sse(ERROR_EVENT)),
             "abort_event": (200, _sse(REFUSED_STREAMED))}[refusal]
    engine = _Engine([first, (200, _sse(reply) if stream else json.dumps(reply).encode())])
    sessions = _EngineSessions()
    call, metrics = _call(family, engine, sessions, stream)

    async def run() -> Any:
        await call.open()
        out, body = await call.reply(_never, _Listener() if stream else None)
        return out, body

    out, body = asyncio.run(run())
    assert out.message["content"] == "Hello there."
    assert (body is None) == stream  # a plain turn's reply is built with its decode
    assert (sessions.opened, sessions.forgotten, _reopens(metrics)) == (2, 1, 1)
    sent = [json.loads(p) for p in engine.sent]
    assert [p["session_params"]["id"] for p in sent] == ["s-1", "s-2"]
    assert sent[0]["input_ids"] == sent[1]["input_ids"]
    # A new rid: SGLang's abort of the refused stream's rid, once its response ends, must not hit the resent one.
    assert sent[0]["rid"] == call.turn.rid != sent[1]["rid"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_lost_twice_or_without_engine_sessions_reaches_the_agent(families: dict[str, ModelFamily],
                                                                           stream: bool) -> None:
    family = families["qwen3"]
    gone = (200, _sse(REFUSED_STREAMED)) if stream else REFUSED_PLAIN
    for sessions, script in ((_EngineSessions(), [gone, gone]), (None, [gone])):
        call, metrics = _call(family, _Engine(list(script)), sessions, stream)

        async def run(call: EngineCall[Any] = call) -> None:
            await call.open()
            await call.reply(_never, _Listener() if stream else None)

        with pytest.raises(EngineRefusedError) as refused:
            asyncio.run(run())
        assert refused.value.engine_status == 400 and GONE in json.loads(refused.value.body)["error"]["message"]
        call.close()
        assert _reopens(metrics) == (1 if sessions is not None else 0)
        if sessions is not None:
            assert sessions.dirty == 1  # it reached the engine and committed nothing


def test_the_deadline_ends_both_modes_with_one_text(families: dict[str, ModelFamily]) -> None:
    """An engine that never answers: the turn ends at --request-timeout, its request abandoned, in both modes with
    the same error (a reply twenty times longer than the deadline is not needed: this one never comes; the deadline
    passes on the loop's virtual clock)."""
    family = families["qwen3"]
    errors: list[SessionError] = []
    for stream in (False, True):
        call, _ = _call(family, _Engine([None]), None, stream, timeout=0.2)

        async def run(call: EngineCall[Any] = call, stream: bool = stream) -> None:
            await call.open()
            await call.reply(_never, _Listener() if stream else None)

        with pytest.raises(EngineTimeoutError) as timed_out:
            virtual_time.run(run())
        assert timed_out.value.abort_reason is AbortReason.TIMEOUT  # type: ignore[attr-defined]
        assert call.abandoned
        errors.append(timed_out.value)
    assert errors[0].message == errors[1].message
    assert "0.2s" in errors[0].message


def test_a_refusal_in_a_stream_is_told_from_every_other_final_event(families: dict[str, ModelFamily]) -> None:
    family = families["qwen3"]
    refused = refused_in_stream(json.dumps(REFUSED_STREAMED).encode())
    assert refused is not None and refused.engine_status == 400
    assert engine_session_gone(refused.engine_status, refused.body)
    weight_update = {**REFUSED_STREAMED, "meta_info": {
        **REFUSED_STREAMED["meta_info"], "finish_reason": {"type": "abort", "message": "Abort all requests"}}}
    said = _reply(family, 'It said "status_code": 400.')
    for event in (weight_update, said, _reply(family)):
        assert refused_in_stream(json.dumps(event).encode()) is None
    assert refused_in_stream(b'{"meta_info": "status_code"') is None  # not JSON: the strict decode's business
