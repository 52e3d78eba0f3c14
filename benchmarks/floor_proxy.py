"""The floor: the least any chat proxy on our stack costs, measured beside the session server in every benchmark.

Absolute CPU figures move about 4x between our machines (docs/design.md 7), so the benchmarks report the session
server's CPU per turn and per chat as a multiple of this proxy's, measured in the same run on the same pinned cores
against the same engine. It is the same stack -- uvicorn (uvloop + httptools, one worker), Starlette, the session
server's own engine client -- relaying the same chats to the same engine, and nothing else: no TITO (the messages' text
is joined and sent as `text`, which the engine tokenizes on its own core), no validation, no session bookkeeping, no
tool or field handling. Engine replies are decoded as the server does (the routed-experts payload cut out first, the
rest by a typed msgspec decode), and answered as an OpenAI chat completion; `stream: true` relays the engine's SSE
events as OpenAI chunks of the new text.

    python -m benchmarks.floor_proxy --engine-url http://127.0.0.1:30000 --port 0

Routes: the session server's chat routes and the few a benchmark needs around them (`POST /sessions`, `DELETE
/sessions/{id}`, `GET /health`).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from session_server.engine import pacing
from session_server.engine.client import EngineClient
from session_server.engine.wire import split_routed_experts

PROG = "floor-proxy"
_encode = msgspec.json.Encoder().encode
_ids = itertools.count()


class _Message(msgspec.Struct):
    content: str | None = None


class _Chat(msgspec.Struct):
    messages: list[_Message]
    max_tokens: int | None = None
    temperature: float | None = None
    stream: bool = False


class _Meta(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Any = None


class _Reply(msgspec.Struct):
    text: str = ""
    meta_info: _Meta = msgspec.field(default_factory=_Meta)


_decode_chat = msgspec.json.Decoder(_Chat).decode
_decode_reply = msgspec.json.Decoder(_Reply).decode


def _generate_body(chat: _Chat, rid: str, routed_experts: bool, deltas: bool, stream_interval: int) -> bytes:
    sampling: dict[str, Any] = {"max_new_tokens": chat.max_tokens}
    if chat.temperature is not None:
        sampling["temperature"] = chat.temperature
    if chat.stream and stream_interval >= 0:  # what the session server asks for the same chat
        sampling["stream_interval"] = pacing.stream_interval(stream_interval, deltas, chat.max_tokens, None)
    body: dict[str, Any] = {
        "text": "\n".join(m.content or "" for m in chat.messages), "sampling_params": sampling,
        "return_logprob": True, "logprob_start_len": -1, "rid": rid, "stream": chat.stream,
    }
    if routed_experts:
        body["return_routed_experts"] = True
    return _encode(body)


def build_app(engine: EngineClient, routed_experts: bool, deltas: bool, stream_interval: int = 0) -> Starlette:
    async def health(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def create(request: Request) -> Response:
        await request.body()
        return Response(_encode({"session_id": f"floor-{next(_ids)}"}), media_type="application/json")

    async def delete(request: Request) -> Response:
        return Response(status_code=204)

    async def chat(request: Request) -> Response:
        sid = request.path_params["sid"]
        body = _decode_chat(await request.body())
        rid = f"{sid}-{next(_ids)}"
        payload = _generate_body(body, rid, routed_experts, deltas, stream_interval)
        if body.stream:
            return StreamingResponse(_relay(engine, payload, sid, rid, deltas), media_type="text/event-stream")
        reply = await engine.generate(payload, sid)
        if not reply.ok:
            return Response(reply.body, status_code=reply.status, media_type=reply.content_type)
        out = _decode_reply(split_routed_experts(reply.body)[0])
        meta = out.meta_info
        return Response(_encode({
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": "floor",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": "length" if _kind(meta.finish_reason) == "length" else "stop"}],
            "usage": {"prompt_tokens": meta.prompt_tokens, "completion_tokens": meta.completion_tokens,
                      "total_tokens": meta.prompt_tokens + meta.completion_tokens},
        }), media_type="application/json")

    return Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/sessions", create, methods=["POST"]),
        Route("/sessions/{sid}", delete, methods=["DELETE"]),
        Route("/sessions/{sid}/v1/chat/completions", chat, methods=["POST"]),
    ])


def _kind(finish: Any) -> Any:
    return finish.get("type") if isinstance(finish, dict) else finish


async def _relay(engine: EngineClient, payload: bytes, sid: str, rid: str, deltas: bool) -> AsyncIterator[bytes]:
    """Engine SSE in, OpenAI chunks of the new text out: each event decoded (the least a relay can do), the new text
    cut from a cumulative event by the length already sent, a delta event's text sent as it is."""
    sent = 0
    head = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "model": "floor"}
    async with engine.stream_generate(payload, sid) as stream:
        buffer = b""
        async for chunk in stream.aiter_bytes():
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                event = _decode_reply(split_routed_experts(line[5:])[0])
                text = event.text if deltas else event.text[sent:]
                sent += len(text)
                finish = _kind(event.meta_info.finish_reason)
                yield b"data: " + _encode({**head, "choices": [
                    {"index": 0, "delta": {"content": text}, "finish_reason": finish}]}) + b"\n\n"
    yield b"data: [DONE]\n\n"


class _Server(uvicorn.Server):
    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1]
            print(f"{PROG} ready on http://{self.config.host}:{port}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-url", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--engine-connections", type=int, default=256)
    p.add_argument("--return-routed-experts", action="store_true", help="ask the engine for routed experts")
    p.add_argument("--engine-incremental-streaming", action="store_true",
                   help="the engine streams deltas (SGLang --incremental-streaming-output), as the server's flag")
    p.add_argument("--engine-stream-interval", type=int, default=0,
                   help="tokens per engine stream event asked for, as the session server's flag (0: what the server "
                   "chooses by default, engine/pacing.py); -1: none asked, the engine's own interval")
    args = p.parse_args(argv)
    engine = EngineClient(args.engine_url, timeout=600.0, connections=args.engine_connections)
    app = build_app(engine, args.return_routed_experts, args.engine_incremental_streaming,
                    args.engine_stream_interval)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, loop="uvloop",
        http="httptools", lifespan="off", workers=1, access_log=False, log_level="warning", server_header=False,
        proxy_headers=False, backlog=4096,
    )
    _Server(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
