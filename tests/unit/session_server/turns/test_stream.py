"""session_server.turns.stream: a streamed turn end to end on the in-process app (tests/support/inprocess_app.py),
with a scripted engine stream and an agent driven by hand over ASGI (so it can leave mid-stream).

What a streamed turn must hold, whatever the engine does: the agent's chunks assemble to exactly the committed
message, and the turn is committed once the final event is checked; an engine error mid-stream ends the stream with
the front end's error event and commits nothing; an agent that leaves mid-stream gets the engine request aborted by
its rid (engine/drains.py), and nothing is committed -- the session takes its next turn at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette

from session_server.engine.client import Answer
from session_server.engine.drains import EngineDrains
from session_server.metrics import Metrics
from session_server.state import ServerState
from support.inprocess_app import StubEngine, client_of, in_process_app
from trajectory import ModelFamily

TEXT = "One two three four five six seven eight."


class _Stream:
    """An engine's streamed /generate: its pieces come as the test lets them (`None` in the script: wait for
    `more`; an exhausted script: wait for ever, as an engine still generating)."""

    def __init__(self, script: list[bytes | None]) -> None:
        self.status_code = 200
        self.headers = {"content-type": "text/event-stream"}
        self._script = script
        self.more = asyncio.Event()
        self.closed = False

    async def aread(self) -> bytes:
        raise AssertionError("a 200 stream is read as it comes")

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            for piece in self._script:
                if piece is None:
                    await self.more.wait()
                    self.more.clear()
                    continue
                yield piece
            await asyncio.Event().wait()  # still generating: only an abort or a closed connection ends it
        finally:
            self.closed = True


class _Engine(StubEngine):
    """The in-process app's engine with a streamed /generate and an abort that ends the request (as SGLang's does:
    its stream then ends; here the test's stream is closed by the drain)."""

    def __init__(self, script: list[bytes | None]) -> None:
        super().__init__()
        self.stream = _Stream(script)
        self.payloads: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.abort_came = asyncio.Event()

    def place(self, session_id: str) -> None:
        pass

    @contextlib.asynccontextmanager
    async def stream_generate(self, payload: bytes, routing_key: str) -> AsyncIterator[_Stream]:
        self.payloads.append(json.loads(payload))
        yield self.stream

    async def abort(self, rid: str, routing_key: str | None = None) -> Answer:
        self.aborted.append(rid)
        self.abort_came.set()
        return Answer.DONE


def _events(family: ModelFamily, pieces: list[str]) -> tuple[list[bytes], bytes]:
    """SGLang's cumulative events for a reply made of `pieces`, and its final event (then `[DONE]`)."""
    events, text, ids = [], "", []
    for n, piece in enumerate(pieces):
        text += piece
        ids += family.tokenizer.encode(piece, add_special_tokens=False)
        final = n == len(pieces) - 1
        meta = {"id": "r", "finish_reason": {"type": "length", "length": len(ids)} if final else None,
                "prompt_tokens": 9, "completion_tokens": len(ids), "cached_tokens": 0,
                "output_token_logprobs": [[-0.25, t, None] for t in ids]}
        events.append(b"data: " + json.dumps({"text": text, "output_ids": ids, "meta_info": meta}).encode() + b"\n\n")
    return events[:-1], events[-1] + b"data: [DONE]\n\n"


class _Agent:
    """An agent's streamed chat over ASGI: what it was sent, and whether it has left (its receive() then says so)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.got_body = asyncio.Event()
        self.leave = asyncio.Event()

    async def chat(self, app: Starlette, session_id: str) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "Count."}], "stream": True,
                           "max_tokens": 64}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": f"/sessions/{session_id}/v1/chat/completions",
                 "raw_path": f"/sessions/{session_id}/v1/chat/completions".encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"server"), (b"content-type", b"application/json"),
                                              (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("server", 80), "state": {}}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if self.leave.is_set():
                raise OSError("the agent has left")
            self.messages.append(message)
            if message["type"] == "http.response.body" and b"data:" in message.get("body", b""):
                self.got_body.set()

        await app(scope, receive, send)

    @property
    def status(self) -> int:
        return next(int(m["status"]) for m in self.messages if m["type"] == "http.response.start")

    def chunks(self) -> list[dict[str, Any]]:
        raw = b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")
        return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]

    def text(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks() if c.get("choices"))


@contextlib.contextmanager
def _app(family: ModelFamily, engine: _Engine, grace: float = 1.0) -> Iterator[tuple[Starlette, ServerState]]:
    drains = EngineDrains(engine, Metrics(), grace=grace)  # type: ignore[arg-type]
    with in_process_app(family, engine=engine, drains=drains) as (app, server):
        yield app, server


async def _session(app: Starlette) -> str:
    async with client_of(app) as http:
        return str((await http.post("/sessions", json={})).json()["session_id"])


async def _turns(app: Starlette, session_id: str) -> list[Any]:
    async with client_of(app) as http:
        reply = await http.get(f"/sessions/{session_id}")
        assert reply.status_code == 200
        return list(reply.json()["records"])


async def _first_chunk(app: Starlette) -> tuple[str, _Agent, asyncio.Task[None]]:
    """A new session, and its agent's streamed chat once the agent has its first chunk."""
    sid = await _session(app)
    agent = _Agent()
    chat = asyncio.create_task(agent.chat(app, sid))
    await asyncio.wait_for(agent.got_body.wait(), 60)
    return sid, agent, chat


def test_a_streamed_turn_sends_its_chunks_then_commits_what_they_assemble_to(
        families: dict[str, ModelFamily]) -> None:
    family = families["qwen3"]
    intermediate, final = _events(family, ["One two", " three four", " five six", " seven eight."])
    engine = _Engine([intermediate[0], None, *intermediate[1:], final])

    async def run() -> None:
        with _app(family, engine) as (app, _):
            sid, agent, chat = await _first_chunk(app)  # the first text went on before the engine sent more
            assert agent.text() == "One two" and not await _turns(app, sid)
            engine.stream.more.set()
            await asyncio.wait_for(chat, 60)
            assert agent.status == 200
            assert agent.text() == TEXT
            assert agent.chunks()[-1]["choices"][0]["finish_reason"] == "length"
            records = await _turns(app, sid)
            assert len(records) == 1 and records[0]["message"]["content"] == TEXT
            assert engine.aborted == []

    asyncio.run(run())


def test_an_engine_error_mid_stream_ends_it_with_an_error_event_and_commits_nothing(
        families: dict[str, ModelFamily]) -> None:
    family = families["qwen3"]
    intermediate, _ = _events(family, ["One two", " three four", " five"])
    error = b'data: {"error":{"message":"the scheduler died","code":500}}\n\ndata: [DONE]\n\n'
    engine = _Engine([intermediate[0], None, error])

    async def run() -> None:
        with _app(family, engine) as (app, _):
            sid, agent, chat = await _first_chunk(app)
            engine.stream.more.set()
            await asyncio.wait_for(chat, 60)
            assert agent.status == 200  # the reply had begun: the error comes as an event
            assert agent.text() == "One two"
            errors = [c for c in agent.chunks() if "error" in c]
            assert len(errors) == 1 and "scheduler died" in errors[0]["error"]["message"]
            assert agent.messages[-1].get("more_body") is False
            assert await _turns(app, sid) == []

    asyncio.run(run())


@pytest.mark.parametrize("malformed", [False, True])
def test_an_agent_that_leaves_mid_stream_gets_the_engine_request_aborted_by_rid(
        families: dict[str, ModelFamily], malformed: bool) -> None:
    """The agent leaves after its first chunk: the engine request is aborted by its rid, its connection closed, and
    nothing is committed; the session's next turn is not refused as busy. (`malformed`: the engine's events after
    the abort would break the stream; they are nobody's.)"""
    family = families["qwen3"]
    intermediate, _ = _events(family, ["One two", " three"])
    script: list[bytes | None] = [intermediate[0]] + ([None, b"data: {not json\n\n"] if malformed else [])
    engine = _Engine(script)
    # Without the malformed events the stream never ends by itself: the drain's grace ends it, short here.
    grace = 1.0 if malformed else 0.05

    async def run() -> None:
        with _app(family, engine, grace) as (app, server):
            sid, agent, chat = await _first_chunk(app)
            agent.leave.set()
            await asyncio.wait_for(engine.abort_came.wait(), 60)
            engine.stream.more.set()  # what the engine sends after the abort is nobody's
            await asyncio.wait_for(chat, 60)
            assert server.drains is not None
            await asyncio.wait_for(server.drains.wait_all(), 60)
            rid = engine.payloads[0]["rid"]
            assert engine.aborted == [rid]
            assert engine.stream.closed
            assert await _turns(app, sid) == []
            # the slot is free: the next turn reaches the engine (which now answers at once)
            again = _Agent()
            _, final = _events(family, ["Done."])
            engine.stream = _Stream([final])
            await asyncio.wait_for(again.chat(app, sid), 60)
            assert again.status == 200 and again.text() == "Done."
            assert len(await _turns(app, sid)) == 1

    asyncio.run(run())
