"""HTTP routes of sglang-sim (Starlette): SGLang's native API plus `/sim/*` test hooks.

Why the disconnect watcher: SGLang aborts a request whose HTTP client went away, and the session server relies on
that to free engine KV when an agent disconnects. After the body is read, the ASGI `receive` channel yields
`http.disconnect` when the client closes, so the handler watches it while the request runs and aborts on it.
Streaming responses get the same from Starlette, which cancels the body iterator on disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sglang_sim import wire
from sglang_sim.auth import ApiKeyMiddleware
from sglang_sim.close_gate import CloseGate
from sglang_sim.engine import Engine
from sglang_sim.faults import BODY_FAULTS, Fault, FaultInjector, corrupt
from sglang_sim.images import EngineCrash, ImageRefusal
from sglang_sim.lora import LoraRefusal, UnloadRefusal
from sglang_sim.requests import (
    BadRequest,
    ContractError,
    FieldValidationError,
    GenerateInput,
    SimRequest,
    ValueRefusal,
    parse_generate,
)
from sglang_sim.routed_experts import payload as routed_payload

JSON = "application/json"
FLUSH_MESSAGE = ("Cache flushed.\nPlease check backend logs for more details. "
                 "(When there are running or waiting requests, the operation will not be performed.)\n")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(wire.encode(obj), status_code=status, media_type=JSON)


def _overflows(fault: Fault | None) -> bool:
    """The fault `mask_overflow`: the request's sampling support overflows the mask cap mid-reply (faults.py)."""
    return fault is not None and fault.name == "mask_overflow"


def error_response(message: str, status: int = 400) -> Response:
    return json_response(wire.native_error(message), status)


class _CrashResponse(Response):
    """What SGLang's HTTP server answers when a handler raises: Starlette's ServerErrorMiddleware sends a plain 500
    (no `Connection: close`) and re-raises, and uvicorn, the response being started, closes the connection, so a
    request pipelined or pooled behind it on that connection is never answered."""

    def __init__(self) -> None:
        super().__init__("Internal Server Error", status_code=500, media_type="text/plain")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        raise _DropStream("sglang-sim emulates SGLang's unhandled exception: the connection closes after the 500")


def crash_response() -> Response:
    return _CrashResponse()


class _DroppedResponse(Response):
    """Announces the full length, sends half the body, then hangs up: a connection dropped mid-body."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body[: len(self.body) // 2], "more_body": True})
        # Returning without the final body message makes the server close the connection.


def _event_counts(seen: int, generated: int, emitted: int, interval: int | None) -> list[int]:
    """The token counts at which tokens (seen, generated] produce stream events: SGLang's rule (output_streamer.py
    `accept`, one decode step per token) -- every token at interval 1; else the first token at once, then whenever
    `interval` tokens are unsent. `interval` None: one event per decode wake-up (the sim's cheap default)."""
    if interval is None:
        return [generated]
    counts = []
    for count in range(seen + 1, generated + 1):
        unsent = count - emitted
        if interval == 1 or unsent >= interval or (emitted == 0 and unsent > 0):
            counts.append(count)
            emitted = count
    return counts


class _DropStream(Exception):
    """Raised inside a stream to cut the connection mid-body."""


async def _refusal_stream(message: str) -> AsyncIterator[bytes]:
    """SGLang reports a streamed request its tokenizer manager refused inside the stream, with HTTP 200 (http_server.py
    `stream_results`): one error event, then `[DONE]`."""
    yield b"data: " + wire.encode(wire.stream_error(message)) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from exc


async def _json_fields(request: Request) -> dict[str, Any]:
    """The body of a control endpoint whose fields all have defaults: a body that is not an object sets none of them."""
    body = await _json_body(request)
    return body if isinstance(body, dict) else {}


@dataclass
class SimServer:
    """Route handlers over one engine."""

    engine: Engine
    faults: FaultInjector
    model_path: str
    tokenizer_path: str
    routed_experts_layers: int = 0  # 0: the engine was not launched with --enable-return-routed-experts
    routed_experts_top_k: int = 8
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    admin_api_key: str | None = None
    health_latency_s: float = 1.0  # real SGLang's GET /health runs a one-token generation: at least a second
    # rid -> its abort, while a delay fault holds the request
    delayed: dict[str, asyncio.Event] = field(default_factory=dict)
    close_gate: CloseGate = field(default_factory=CloseGate)

    # -- /generate ------------------------------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        body: Any = None
        try:
            body = await _json_body(request)
            inp = parse_generate(body, self.engine.family.vocab_size, request.headers.get("x-smg-routing-key"))
            fault = self.faults.pick(request.headers.get("x-sim-fault"))
            if fault is not None and fault.name == "value_error":
                raise ValueRefusal("sglang-sim injected fault: value_error")
        except ContractError as exc:  # http_server.py generate_request: the contract gate's own text, unwrapped
            return json_response({"error": str(exc)}, 400)
        except FieldValidationError as exc:  # http_server.py validation_exception_handler: an ErrorResponse
            return json_response(wire.validation_error(str(exc)), 400)
        except ValueRefusal as exc:
            if isinstance(body, dict) and body.get("stream") is True:
                return StreamingResponse(_refusal_stream(str(exc)), media_type="text/event-stream")
            return error_response(str(exc))
        except BadRequest as exc:
            return error_response(str(exc))
        if fault is not None and fault.name == "http_500":
            return error_response("sglang-sim injected fault: http_500", status=500)
        if inp.stream:
            return StreamingResponse(self._stream(inp, fault), media_type="text/event-stream")
        holder: list[SimRequest] = []
        gone = asyncio.Event()

        def on_disconnect() -> None:
            gone.set()
            for req in holder:
                self.engine.abort_request(req)

        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(request.receive, on_disconnect))
        try:
            if fault is not None and fault.delay > 0:
                # A delayed request is already known by its rid (as in SGLang's rid_to_state): an abort ends it.
                self.delayed[inp.rid] = gone
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gone.wait(), fault.delay)
                finally:
                    self.delayed.pop(inp.rid, None)
            if gone.is_set():
                return Response(status_code=499)
            try:
                req = self.engine.submit(inp, mask_overflow=_overflows(fault))
            except (BadRequest, ImageRefusal) as exc:
                return error_response(str(exc))
            except EngineCrash:
                return crash_response()
            holder.append(req)
            await req.done.wait()
        finally:
            watcher.cancel()
        if req.overflow is not None:  # tokenizer_manager.py _handle_abort_finish_reason: a 400 raised as ValueError
            return error_response(str(req.overflow["message"]))
        body = wire.generate_body(self.engine, req, final=True, routed=self._routed(req))
        return self._encode_final(body, fault)

    def _routed(self, req: SimRequest) -> str | None:
        inp = req.inp
        if self.routed_experts_layers <= 0 or not inp.return_routed_experts or req.aborted_waiting:
            return None
        sequence = np.concatenate([req.prompt, req.output_ids])
        return routed_payload(sequence, inp.routed_experts_start_len, self.routed_experts_layers,
                              self.routed_experts_top_k)

    def _encode_final(self, body: dict[str, Any], fault: Fault | None) -> Response:
        if fault is not None and fault.name in BODY_FAULTS:
            return Response(corrupt(body, fault, self.engine.family.vocab_size), media_type=JSON)
        raw = wire.encode(body)
        if fault is not None and fault.name == "drop_connection":
            return _DroppedResponse(raw, media_type=JSON)
        return Response(raw, media_type=JSON)

    async def _stream(self, inp: GenerateInput, fault: Fault | None) -> AsyncIterator[bytes]:
        """SSE with cumulative chunks (or deltas with --incremental-streaming-output), SGLang style; on disconnect
        Starlette cancels us and we abort."""
        req: SimRequest | None = None
        try:
            if fault is not None and fault.delay > 0:
                await asyncio.sleep(fault.delay)
            try:
                req = self.engine.submit(inp, mask_overflow=_overflows(fault))
            except (BadRequest, ImageRefusal) as exc:
                async for chunk in _refusal_stream(str(exc)):
                    yield chunk
                return
            except EngineCrash as exc:  # SGLang's stream dies with the exception: headers sent, then a hang-up
                raise _DropStream(f"sglang-sim emulates SGLang's crash: {exc}") from None
            deltas = self.engine.config.incremental_streaming_output
            events = wire.StreamEvents(self.engine, req, deltas)
            interval = inp.sampling.stream_interval or self.engine.config.stream_interval
            seen = 0  # tokens generated at the last look
            while True:
                req.progress.clear()
                finished = req.state == "finished"
                # With a stream interval every token counts, also those a finished request made at once; the last
                # one comes with the final event.
                upto = req.generated - 1 if finished and interval is not None else req.generated
                if not finished or interval is not None:
                    for count in _event_counts(seen, upto, events.count, interval) if upto > seen else ():
                        yield b"data: " + events.event(count) + b"\n\n"
                    seen = max(seen, upto)
                if finished:
                    break
                if req.generated == seen:
                    await req.progress.wait()
            body = wire.generate_body(self.engine, req, final=True, routed=self._routed(req), streamed=events.sent)
            if deltas:
                body = wire.incremental(body, events.count, events.text_sent)
            if fault is not None and fault.name in BODY_FAULTS:
                yield b"data: " + corrupt(body, fault, self.engine.family.vocab_size) + b"\n\n"
            elif fault is not None and fault.name == "drop_connection":
                chunk = wire.encode(body)
                yield b"data: " + chunk[: len(chunk) // 2]
                raise _DropStream("sglang-sim injected fault: drop_connection")
            else:
                yield b"data: " + wire.encode(body) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if req is not None and req.state != "finished":
                self.engine.abort_request(req)

    # -- control endpoints ----------------------------------------------------------------------------------------

    async def abort_request(self, request: Request) -> Response:
        try:
            body = await _json_fields(request)
        except BadRequest as exc:
            return error_response(str(exc))
        rid = body.get("rid")
        abort_all = bool(body.get("abort_all", False))
        self.engine.abort(rid if isinstance(rid, str) else None, abort_all=abort_all)
        for delayed_rid, gone in list(self.delayed.items()):
            if abort_all or delayed_rid == rid:
                gone.set()
        return Response(status_code=200)

    async def open_session(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            if not isinstance(body, dict):
                raise BadRequest("open_session body must be a JSON object")
            sid = body.get("session_id")
            timeout = body.get("timeout")
            if sid is not None and not isinstance(sid, str):
                raise BadRequest("session_id must be a string")
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
                raise BadRequest("timeout must be a number")
            capacity = body.get("capacity_of_str_len") or 0
            if isinstance(capacity, bool) or not isinstance(capacity, int):
                raise BadRequest("capacity_of_str_len must be an integer")
            session_id = self.engine.open_session(sid, capacity, bool(body.get("streaming", False)),
                                                  float(timeout) if timeout is not None else None)
        except BadRequest as exc:
            return error_response(str(exc))
        return json_response(session_id)

    async def close_session(self, request: Request) -> Response:
        try:
            body = await _json_fields(request)
        except BadRequest as exc:
            return error_response(str(exc))
        await self.close_gate.passage()  # held by the /sim/hold_closes test hook, else at once
        sid = body.get("session_id")
        if isinstance(sid, str):
            self.engine.close_session(sid)
        self.close_gate.answered += 1
        return Response(status_code=200)

    async def pause_generation(self, request: Request) -> Response:
        try:
            mode = (await _json_fields(request)).get("mode", "abort")
            await self.engine.pause(str(mode))
        except BadRequest as exc:
            return error_response(str(exc))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        self.engine.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def slow_down(self, request: Request) -> Response:
        """SGLang's test hook: `forward_sleep_time` seconds of sleep before every forward step from now on (null or
        <= 0: none), on top of --token-latency-ms. Tests pace an engine with it, the real one and this one alike.
        A body FastAPI's parse refuses gets its validation error (400)."""
        try:
            body = await _json_body(request)
        except BadRequest as exc:
            return json_response(wire.validation_error(str(exc)), 400)
        if not isinstance(body, dict) or "forward_sleep_time" not in body:
            return json_response(wire.validation_error("forward_sleep_time: Field required"), 400)
        seconds = body["forward_sleep_time"]
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float)
                                    or not math.isfinite(seconds)):
            return json_response(wire.validation_error("forward_sleep_time: Input should be a valid number"), 400)
        self.engine.slow_down(None if seconds is None else float(seconds))
        return json_response(None)

    async def flush_cache(self, request: Request) -> Response:
        ok = self.engine.flush_cache()
        return Response(FLUSH_MESSAGE, status_code=200 if ok else 400, media_type="text/plain")

    async def health(self, request: Request) -> Response:
        """GET /health and /health_generate: like SGLang's `health_generate`, a one-token generation that answers
        after at least a second (it polls the detokenizer once per second), so a caller that probes it on a hot path
        shows up as slow. 503 while paused, where SGLang's generation would not come back."""
        await asyncio.sleep(self.health_latency_s)
        return Response(status_code=503 if self.engine.paused else 200)

    async def ready(self, request: Request) -> Response:
        """GET /ready: SGLang's cheap probe (`tokenizer_manager.is_ready()`: not paused and healthy), empty body."""
        return Response(status_code=503 if self.engine.paused else 200)

    async def update_weight_version(self, request: Request) -> Response:
        """POST /update_weight_version `{"new_version", "abort_all_requests"=true}` (http_server.py
        `update_weight_version`): requests already generating record the change, so their final meta_info carries
        per-token `weight_versions` spans."""
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
                raise BadRequest("new_version must be a string")
        except BadRequest as exc:
            return error_response(str(exc))
        if body.get("abort_all_requests", True):
            self.engine.abort(None, abort_all=True)
        self.engine.set_weight_version(body["new_version"])
        return json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                              "new_version": body["new_version"]})

    async def update_weights_from_disk(self, request: Request) -> Response:
        """POST /update_weights_from_disk `{"model_path", "abort_all_requests"=false, "weight_version"?,
        "flush_cache"=true}` (http_server.py, tokenizer_manager.py, scheduler_components/weight_updater.py): every
        in-flight request aborted first when asked, the weights "loaded" (the sim has none), the version changed as
        `/update_weight_version` changes it, then the cache flushed, which fails the call (400, `success` false) while
        requests still run or wait."""
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
                raise BadRequest("model_path must be a string")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest("weight_version must be a string")
        except BadRequest as exc:
            return error_response(str(exc))
        if body.get("abort_all_requests", False):
            self.engine.abort(None, abort_all=True)
        if version is not None:
            self.engine.set_weight_version(version)
        success, message = True, "Succeeded to update model weights."
        if body.get("flush_cache", True) and not self.engine.flush_cache():
            success, message = False, ("Weights were updated, but the cache was not flushed because requests are "
                                       "still running or queued. Retract or finish them, then call /flush_cache.")
        if success and version is not None:
            message += f" Weight version updated to {version}."
        return json_response({"success": success, "message": message, "num_paused_requests": 0},
                             200 if success else 400)

    def _lora_answer(self, error: LoraRefusal | BadRequest | None) -> Response:
        """A load or unload answer as SGLang's (`LoadLoRAAdapterReqOutput`): 200 with the adapters loaded now, or 400
        with the message (an unload's refusal carries no adapter list)."""
        loaded = None if isinstance(error, UnloadRefusal) else self.engine.lora.described()
        return json_response({"rid": None, "http_worker_ipc": None, "success": error is None,
                              "error_message": "" if error is None else str(error), "loaded_adapters": loaded},
                             200 if error is None else 400)

    async def load_lora_adapter(self, request: Request) -> Response:
        """POST /load_lora_adapter `{"lora_name", "lora_path"}` (sglang_sim/lora.py)."""
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not isinstance(
                    body.get("lora_path"), str):
                raise BadRequest("lora_name and lora_path must be strings")
            self.engine.lora.load(body["lora_name"], body["lora_path"])
        except (BadRequest, LoraRefusal) as exc:
            return self._lora_answer(exc)
        return self._lora_answer(None)

    async def unload_lora_adapter(self, request: Request) -> Response:
        """POST /unload_lora_adapter `{"lora_name"}` (sglang_sim/lora.py)."""
        try:
            body = await _json_body(request)
            if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
                raise BadRequest("lora_name must be a string")
            self.engine.lora.unload(body["lora_name"])
        except (BadRequest, LoraRefusal) as exc:
            return self._lora_answer(exc)
        return self._lora_answer(None)

    async def model_info(self, request: Request) -> Response:
        return json_response(wire.model_info(self.engine, self.model_path, self.tokenizer_path))

    async def server_info(self, request: Request) -> Response:
        return json_response(wire.server_info(self.engine, self.model_path, self.tokenizer_path, self.host,
                                              self.port))

    async def v1_loads(self, request: Request) -> Response:
        return json_response(wire.v1_loads(self.engine))

    async def get_load(self, request: Request) -> Response:
        return json_response(wire.get_load(self.engine))

    async def models(self, request: Request) -> Response:
        return json_response(wire.models_list(self.engine, self.model_path))

    async def retrieve_model(self, request: Request) -> Response:
        """SGLang's `/v1/models/{model:path}`: the served model's card, else OpenAI's 404."""
        model = request.path_params["model"]
        for card in wire.models_list(self.engine, self.model_path)["data"]:
            if card["id"] == model:
                return json_response(card)
        return json_response({"error": {"message": f"The model '{model}' does not exist",
                                        "type": "invalid_request_error", "param": "model",
                                        "code": "model_not_found"}}, 404)

    # -- /sim test hooks ------------------------------------------------------------------------------------------

    async def sim_faults(self, request: Request) -> Response:
        if request.method == "GET":
            return json_response(self.faults.state())
        try:
            return json_response(self.faults.configure(await _json_body(request)))
        except BadRequest as exc:
            return error_response(str(exc))

    async def sim_hold_closes(self, request: Request) -> Response:
        """GET: the close gate's counts; POST `{"hold": bool}`: hold `/close_session` calls, or release them."""
        if request.method == "POST":
            try:
                hold = (await _json_fields(request)).get("hold")
            except BadRequest as exc:
                return error_response(str(exc))
            if not isinstance(hold, bool):
                return error_response("'hold' must be true or false")
            self.close_gate.hold(hold)
        return json_response(self.close_gate.state())

    async def sim_books(self, request: Request) -> Response:
        return json_response(self.engine.check_books())

    # -- wiring ---------------------------------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        get_post = ["GET", "POST"]
        return [
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
            Route("/open_session", self.open_session, methods=get_post),
            Route("/close_session", self.close_session, methods=get_post),
            Route("/pause_generation", self.pause_generation, methods=["POST"]),
            Route("/continue_generation", self.continue_generation, methods=["POST"]),
            Route("/flush_cache", self.flush_cache, methods=get_post),
            Route("/slow_down", self.slow_down, methods=get_post),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/update_weight_version", self.update_weight_version, methods=["POST"]),
            Route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"]),
            Route("/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/v1/loads", self.v1_loads, methods=["GET"]),
            Route("/get_load", self.get_load, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.retrieve_model, methods=["GET"]),
            Route("/sim/faults", self.sim_faults, methods=get_post),
            Route("/sim/books", self.sim_books, methods=["GET"]),
            Route("/sim/hold_closes", self.sim_hold_closes, methods=get_post),
        ]

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            reaper = asyncio.get_running_loop().create_task(self._reap_forever())
            try:
                yield
            finally:
                reaper.cancel()
                await self.engine.shutdown()

        app = Starlette(routes=self.routes(), lifespan=lifespan)
        if self.api_key or self.admin_api_key:
            app.add_middleware(ApiKeyMiddleware, api_key=self.api_key, admin_api_key=self.admin_api_key)
        return app

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.engine.reap_sessions()
