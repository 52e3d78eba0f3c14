"""A turn's engine as a test drives it, for the in-process app (tests/support/inprocess_app.py): each /generate waits
until the test answers it, an abort by rid ends the request as SGLang does (finish_reason abort), and the client's
connection can be hung up.

So a test can hold a chat at the engine, look at the server's state while it waits, and decide what ends it first
(the engine's reply, an error, the client going away, an abort) -- by events, never by timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette

from session_server.engine.client import Answer, EngineReply
from session_server.engine.drains import EngineDrains
from session_server.http.disconnect import EXTENSION, WATCH
from session_server.metrics import Metrics
from session_server.sessions.session import Session
from session_server.state import ServerState
from support.bounded import BOUND, bounded
from support.inprocess_app import StubEngine, in_process_app
from support.tito import engine_body
from trajectory import ModelFamily

ABORTED_BY_ENGINE = {"type": "abort", "message": "Aborted"}  # SGLang's abort of every request (a weight update)


@dataclass
class GenerateCall:
    """One /generate the server sent: its payload, and the answer the test gives it."""

    payload: dict[str, Any]
    answer: asyncio.Future[EngineReply] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def rid(self) -> str:
        return str(self.payload["rid"])

    @property
    def input_ids(self) -> list[int]:
        return list(self.payload["input_ids"])

    def reply(self, body: dict[str, Any] | bytes, status: int = 200) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        if not self.answer.done():
            self.answer.set_result(EngineReply(status, raw, "application/json"))


class TurnEngine(StubEngine):
    """The placement's session-keyed /generate and /abort_request; requests queue up for the test to answer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight_version = "w0"  # what reply_body names by default: the weights the server keys its calls by
        self.generated: list[GenerateCall] = []
        self.aborted: list[str] = []
        self._arrived: asyncio.Queue[GenerateCall] = asyncio.Queue()

    def place(self, session_id: str) -> None:
        self.calls.append("place")

    async def generate(self, payload: bytes, routing_key: str) -> EngineReply:
        call = GenerateCall(json.loads(payload))
        self.generated.append(call)
        self._arrived.put_nowait(call)
        return await call.answer

    async def abort(self, rid: str, routing_key: str | None = None) -> Answer:
        """SGLang ends an aborted request with what it sampled so far (nothing here) and finish_reason abort."""
        self.aborted.append(rid)
        for call in self.generated:
            if call.rid == rid:
                call.reply(engine_body([], finish={"type": "abort", "message": "Abort before prefill"}, rid=rid))
        return Answer.DONE

    async def next_call(self) -> GenerateCall:
        """The next /generate the server sends (bounded)."""
        return await bounded(self._arrived.get())


@contextlib.contextmanager
def turn_app(family: ModelFamily, **config: Any) -> Iterator[tuple[Starlette, ServerState, TurnEngine, Session]]:
    """The in-process app with a TurnEngine and the real drains (an engine call that loses its race is aborted by
    its rid as in the server), and a new session on it (`config`: ServerConfig fields)."""
    engine = TurnEngine()
    drains = EngineDrains(engine, Metrics(), grace=BOUND)  # type: ignore[arg-type]  # the placement's abort
    with in_process_app(family, engine=engine, drains=drains, **config) as (app, server):
        yield app, server, engine, server.lifecycle.create(server.new_segments())


def chat_path(session_id: str) -> str:
    return f"/sessions/{session_id}/v1/chat/completions"


def start_chat(http: httpx.AsyncClient, session_id: str, *messages: dict[str, Any],
               **fields: Any) -> asyncio.Task[httpx.Response]:
    """A Chat Completions turn on the session, sent in the background: the test answers its engine call meanwhile
    (`fields`: other request fields)."""
    body = {"model": "qwen/tiny", "messages": list(messages), **fields}
    return asyncio.create_task(http.post(chat_path(session_id), json=body))


def reply_body(family: ModelFamily, call: GenerateCall, text: str, *, weight_version: str = "w0",
               finish: dict[str, Any] | None = None) -> dict[str, Any]:
    """The engine's reply to `call`: `text` tokenized, ending with the family's stop token unless `finish` says
    otherwise (an abort: `text` is what was sampled before it)."""
    ids = family.encode(text)
    if finish is None:
        ids.append(family.stop_token_after(text))
    return engine_body(ids, finish=finish, prompt_tokens=len(call.input_ids), text=text, rid=call.rid,
                       weight_version=weight_version)


class Hangups:
    """The app behind the server's own disconnect hook (http/disconnect.py): `hang_up()` is every client going away,
    as our protocol reports a lost connection."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self._watchers: list[Callable[[], None]] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        scope["extensions"] = {**(scope.get("extensions") or {}), EXTENSION: {WATCH: self._watch}}
        await self.app(scope, receive, send)

    def _watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback) if callback in self._watchers else None

    @property
    def watched(self) -> int:
        """Requests whose client is being watched now."""
        return len(self._watchers)

    def hang_up(self) -> None:
        for callback in list(self._watchers):
            callback()
