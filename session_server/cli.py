"""`session-server`: parse flags, load the tokenizer, serve the app with one uvicorn worker (uvloop + httptools).

One worker on purpose: sessions live in this process's memory and the in-flight gate relies on a single event loop.
Scale out with several processes on different ports (the session URL pins an episode to its server).
Graceful SIGTERM: the first signal refuses new chats and aborts in-flight engine requests (their chats answer 503),
uvicorn then stops accepting and drains connections, and the lifespan closes engine sessions; the exit code is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn

from session_server.config import ServerConfig
from session_server.engine import pacing
from session_server.engine.client import ENGINE_CLIENTS
from session_server.http.limits import limited_httptools
from session_server.sessions.journal import SYNC_MODES
from trajectory.families import family_names
from trajectory.linear import SPECIAL_TOKEN_MODES
from trajectory.messages import MATCHER_NAMES as MATCHERS
from trajectory.session_segments import DIVERGENCE_POLICIES

if TYPE_CHECKING:
    from trajectory import ModelFamily

PROG = "session-server"
# Keys are better passed in the environment than on the command line, where any local user can read them (ps).
ENGINE_API_KEY_ENV = "SESSION_SERVER_ENGINE_API_KEY"
ENGINE_ADMIN_API_KEY_ENV = "SESSION_SERVER_ENGINE_ADMIN_API_KEY"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, exit 2 (argparse's default also prints the usage block)."""
        self.exit(2, f"{PROG}: error: {message}\n")


class _EngineUrls(argparse.Action):
    """--engine-url repeats (data-parallel workers): the first is `engine_url`, all of them `engine_urls`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        urls = (*(getattr(namespace, "engine_urls", None) or ()), values)
        namespace.engine_urls = urls
        namespace.engine_url = urls[0]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Token-in-token-out session server between OpenAI-chat agents and SGLang.")
    p.add_argument(
        "--engine-url", required=True, action=_EngineUrls,
        help="SGLang engine base URL (native API), e.g. http://127.0.0.1:30000; repeat it for data-parallel workers "
        "(the server places each session on one; give the engines themselves, not a router in front of them)",
    )
    p.add_argument(
        "--engine-health-interval", type=float, default=_default("engine_health_interval"),
        help="seconds between readiness/load probes of each engine (GET /ready, /v1/loads); an engine that fails "
        "takes no new sessions and its sessions move on their next turn; 0 = probe only on /ready and failures "
        "(default %(default)s)",
    )
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory (loaded with AutoTokenizer)")
    p.add_argument("--model-family", required=True, metavar="NAME",
                   help=f"model family, one of: {', '.join(family_names())}")
    p.add_argument("--host", default=_default("host"), help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=_default("port"), help="port to listen on; 0 picks a free one (default %(default)s)"
    )
    p.add_argument(
        "--cpu-workers", type=int, default=_default("cpu_workers"),
        help="threads for stateless CPU work (decode/encode/serialize); default min(16, cores)",
    )
    p.add_argument("--max-rollback", type=int, default=_default("max_rollback"),
        help="checkpoints a diverging request may drop (default %(default)s)")
    p.add_argument(
        "--on-divergence", choices=DIVERGENCE_POLICIES, default=_default("on_divergence"),
        help="a request whose history extends no segment of its session within --max-rollback (a compaction, a "
             "sub-agent, a side request): 'segment' starts a new segment of the session, 'reject' is a 400 "
             "(default %(default)s)",
    )
    p.add_argument("--max-segments", type=int, default=_default("max_segments"),
        help="segments one session may hold; a request that would start one more gets 400 (default %(default)s)")
    p.add_argument(
        "--merge-segments", action="store_true",
        help="continue a segment instead of starting one when the new history's full render extends every token "
             "of it (one sample per episode where the tokens allow it)",
    )
    p.add_argument(
        "--engine-sessions", action="store_true",
        help="one SGLang streaming session per trajectory; turns send only new tokens (engine: streaming sessions on)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=_default("request_timeout"),
        help="seconds an engine call may take before it is aborted and the chat gets 504 (default %(default)s)",
    )
    p.add_argument(
        "--max-turn-continuations", type=int, default=_default("max_turn_continuations"),
        help="times a turn goes on after the engine aborted every in-flight request (a weight update): prompt + the "
             "tokens sampled so far are resubmitted and the agent sees one reply; past it the turn is a 503 to retry; "
             "0 never continues (default %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=_default("max_request_bytes"),
        help="largest accepted request body in bytes; larger ones get 413 (default %(default)s)",
    )
    p.add_argument("--max-images", type=int, default=_default("max_images"), help="images per request")
    p.add_argument("--max-image-bytes", type=int, default=_default("max_image_bytes"), help="bytes per encoded image")
    p.add_argument("--max-image-pixels", type=int, default=_default("max_image_pixels"), help="pixels per image")
    p.add_argument("--fetch-images", action="store_true", help="fetch http(s) image URLs (else data URLs only)")
    p.add_argument("--image-fetch-timeout", type=float, default=_default("image_fetch_timeout"), help="seconds a fetch")
    p.add_argument(
        "--max-metadata-bytes", type=int, default=_default("max_metadata_bytes"),
        help="largest session metadata (POST /sessions, JSON-encoded bytes); larger gets 413 (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout", type=float, default=_default("body_timeout"),
        help="seconds a request body may take to arrive in full, on every route; slower uploads get 408 "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-header-bytes", type=int, default=_default("max_header_bytes"),
        help="largest request line + headers of one request; larger gets 431 and the connection is closed "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-sessions", type=int, default=_default("max_sessions"),
        help="live sessions the server holds; POST /sessions (and on-demand creation) beyond gets 503 with "
        "Retry-After; 0 = unbounded (default %(default)s)",
    )
    p.add_argument(
        "--max-session-tokens", type=int, default=_default("max_session_tokens"),
        help="tokens one session may hold (prompt + completion): a turn whose prompt reaches it is a 400, and "
        "generation is capped to what is left; 0 = unbounded (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=_default("drain_timeout"),
        help="POST /admin/pause (drain) waits this many seconds for running chats, then aborts the rest (they get "
        "503 + Retry-After), so a weight update can always proceed (default %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=_default("shutdown_timeout"),
        help="on SIGTERM, seconds to wait for open connections (e.g. a half-sent body) before closing them "
        "(default %(default)s)",
    )
    p.add_argument(
        "--special-tokens-in-content", choices=SPECIAL_TOKEN_MODES, default=_default("special_tokens_in_content"),
        help="text (default): spellings of control tokens inside message text, tool arguments and schemas are "
        "tokenized as plain text, so no message can forge chat structure; engine: they become the control tokens, "
        "as the engine's own chat endpoint does",
    )
    p.add_argument(
        "--message-matcher", choices=MATCHERS, default=_default("message_matcher"),
        help="how history is matched: loose_tool_call (default: tool-call arguments that are equal as JSON match, "
        "as agents re-serialise them) or strict (argument text byte for byte; any re-serialisation rolls back)",
    )
    p.add_argument(
        "--engine-incremental-streaming", action="store_true",
        help="the engine runs with SGLang's --incremental-streaming-output (stream events are deltas); default: "
        "SGLang's cumulative events",
    )
    p.add_argument(
        "--stream-coalesce-ms", type=float, default=_default("stream_coalesce_ms"),
        help="a streamed chat reads the engine at most once per this many milliseconds after its first chunk, and "
        "sends what arrived meanwhile as one chunk: with one engine event per token (SGLang's stream_interval 1), "
        "each event on its own costs ~20 us of server CPU, 30x an unstreamed token; 0 = every event as it arrives "
        "(default %(default)s)",
    )
    p.add_argument(
        "--engine-stream-interval", type=int, default=_default("engine_stream_interval"),
        help="tokens per engine stream event asked for (SGLang's per-request stream_interval; the first token "
        f"always comes at once). 0 (default) chooses: {pacing.DELTA_INTERVAL} when the engine streams deltas; with "
        f"cumulative events (each holds the whole reply so far) one per max_tokens/{pacing.CUMULATIVE_EVENTS} tokens, "
        "so a streamed reply stays linear (engine/pacing.py)",
    )
    p.add_argument(
        "--create-sessions-on-demand", action="store_true",
        help="a chat at the root URL (POST /v1/chat/completions) whose X-Session-ID names no session creates it "
        "(ids: 1-128 characters of A-Z a-z 0-9 . _ : -); the client then chooses the id, so it is not a secret",
    )
    p.add_argument(
        "--session-idle-timeout", type=float, default=_default("session_idle_timeout"),
        help="delete a session (like DELETE) after this many seconds without a request; a chat in flight counts as "
        "activity until it outlives --request-timeout; 0 = never (default %(default)s)",
    )
    p.add_argument(
        "--tombstones", type=int, default=_default("tombstones"),
        help="ids of deleted sessions remembered so late requests get 'was deleted'; oldest forgotten first "
        "(default %(default)s, about 200 bytes each)",
    )
    p.add_argument(
        "--admin-token", default=_default("admin_token"), help="if set, /admin/* requires 'Authorization: Bearer TOKEN'"
    )
    p.add_argument(
        "--inline-below-bytes", type=int, default=_default("inline_below_bytes"),
        help="bodies smaller than this are parsed on the event loop, larger ones on the CPU pool "
             "(a pool hop costs more than a small decode); 0 pools everything (default %(default)s)",
    )
    p.add_argument(
        "--first-turn-cache-tokens", type=int, default=_default("first_turn_cache_tokens"),
        help="token ids of first turns kept by their exact request (messages, tools, template kwargs), so the G "
             "samples of a GRPO group render their shared first request once; least recently used out first, "
             "0 keeps none (default %(default)s, 4 bytes each)",
    )
    p.add_argument(
        "--inline-decode", action="store_true",
        help="decode engine responses on the event loop instead of the CPU pool (for benchmarks)",
    )
    p.add_argument(
        "--return-routed-experts", action="store_true",
        help="ask the engine for routed experts (MoE routing replay); kept raw in the records, never sent to agents",
    )
    p.add_argument(
        "--return-token-ids", action="store_true",
        help="put the turn's token ids on every Chat and Responses reply (vLLM's prompt_token_ids and token_ids; "
             "NeMo Gym's fields on Responses items), as a request's own `return_token_ids: true` does",
    )
    p.add_argument(
        "--engine-client", choices=ENGINE_CLIENTS, default=_default("engine_client"),
        help="client for the hot POST /generate: the lean httptools pool (default) or httpx, to measure against it",
    )
    p.add_argument(
        "--engine-api-key", default=os.environ.get(ENGINE_API_KEY_ENV) or None,
        help=f"the engine's --api-key, sent as a Bearer token on /generate and session calls "
             f"(default: ${ENGINE_API_KEY_ENV}; never logged)",
    )
    p.add_argument(
        "--engine-admin-api-key", default=os.environ.get(ENGINE_ADMIN_API_KEY_ENV) or None,
        help=f"the engine's --admin-api-key, sent on abort/pause/flush calls (default: ${ENGINE_ADMIN_API_KEY_ENV}; "
             "never logged)",
    )
    p.add_argument(
        "--engine-control-timeout", type=float, default=_default("engine_control_timeout"),
        help="deadline in seconds of each engine control call (abort, open/close session, ready) "
             "(default %(default)s)",
    )
    p.add_argument(
        "--abort-grace", type=float, default=_default("abort_grace"),
        help="seconds an acknowledged abort may take to end the engine request before the server closes its connection "
             "(default %(default)s)",
    )
    p.add_argument(
        "--journal", default=None, metavar="PATH",
        help="keep every session, committed turn and deletion in this SQLite file (WAL); a restart on the same file "
        "restores the sessions. A turn is on disk before its reply is sent. Default: memory only",
    )
    p.add_argument(
        "--journal-sync", choices=SYNC_MODES, default=_default("journal_sync"),
        help="normal: a replied turn survives the server process being killed (SIGKILL, OOM), not a power loss or "
        "kernel crash; full: fsync on every group commit, survives those too, at more latency per turn "
        "(default normal)",
    )
    p.add_argument(
        "--replica-name", default=None, metavar="NAME",
        help="this replica's name behind a load balancer (a-z 0-9 -): the session ids it mints start with 'NAME.', "
        "and the balancer's config (python -m deploy.nginx) routes them back to it; keep it across restarts",
    )
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"), help="log level")
    return p


def _default(name: str) -> Any:
    """A flag's default is the ServerConfig field's default: written once, in config.py."""
    field = ServerConfig.__dataclass_fields__[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Every ServerConfig field that has a flag of the same name (dashes for underscores) takes the flag's value."""
    given = vars(args)
    return ServerConfig(**{f.name: given[f.name] for f in dataclasses.fields(ServerConfig) if f.name in given})


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


def refuse_routers(config: ServerConfig) -> None:
    """Exit with a clear error when an --engine-url is a router and a flag needs what routers do not forward."""
    if not (config.engine_sessions or config.return_routed_experts):
        return
    from session_server.app import build_engines
    from session_server.engine.placement import startup_refusal

    refusal = asyncio.run(startup_refusal(
        build_engines(config), engine_sessions=config.engine_sessions,
        return_routed_experts=config.return_routed_experts,
    ))
    if refusal is not None:
        _fail(refusal)


_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """Import transformers (and load the tokenizer) in its tokenizer-only mode.

    transformers imports torch whenever torch is installed (~0.8 s of CPU, a third of the start-up), for model
    classes a session server never uses. With torch hidden at its first import, transformers runs as on a machine
    without torch: the same tokenizer class, files and tokens (tested), and an advisory line that torch is missing,
    which is no news here and is not printed. Torch is visible again afterwards; nothing in the server imports it.
    Only for a process that has imported neither yet (the CLI's own process), so a caller's transformers is never
    changed under it."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        yield
        return
    advice = os.environ.get(_NO_ADVICE)
    sys.modules["torch"] = None  # type: ignore[assignment]  # importlib.util.find_spec("torch") is now None
    os.environ[_NO_ADVICE] = "1"
    try:
        yield
    finally:
        del sys.modules["torch"]
        if advice is None:
            del os.environ[_NO_ADVICE]
        else:
            os.environ[_NO_ADVICE] = advice


def load_family(tokenizer_dir: str, family_name: str, *, without_torch: bool = False) -> ModelFamily:
    """The family over the tokenizer in `tokenizer_dir`; exits 2 with a one-line error if either is unusable.
    `without_torch`: load transformers in its tokenizer-only mode (`_torch_hidden`; the CLI's start-up)."""
    from session_server.frontend.images import with_processor_config
    from trajectory import get_family

    if family_name not in family_names():
        _fail(f"unknown --model-family {family_name!r} (known: {', '.join(family_names())})")
    if not any(Path(tokenizer_dir, name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        _fail(f"--tokenizer {tokenizer_dir!r} is not a local tokenizer directory (nothing is downloaded)")
    with _torch_hidden() if without_torch else contextlib.nullcontext():
        from transformers import AutoTokenizer  # slow to import: only once the cheap checks passed

        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        except Exception as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            _fail(f"cannot load tokenizer from {tokenizer_dir!r}: {type(exc).__name__}: {first_line}")
    try:
        return with_processor_config(get_family(family_name, tokenizer), tokenizer_dir)  # images: the checkpoint's
    except Exception as exc:
        _fail(f"tokenizer {tokenizer_dir!r} does not fit family {family_name!r}: {exc}")


class _Server(uvicorn.Server):
    """uvicorn.Server that announces readiness and turns SIGTERM into an abort-first graceful shutdown."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown_started = False
        self._shutdown_task: asyncio.Future[None] | None = None  # held so the task is not garbage-collected

    async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1]
            print(f"{PROG} ready on http://{self.config.host}:{port}", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not calling super(): it records the signal and re-raises it after shutdown, which would kill the
        # process with the signal instead of exiting 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if not self._shutdown_started and self._loop is not None:
            self._shutdown_started = True
            self._loop.call_soon_threadsafe(self._begin_shutdown)

    def _begin_shutdown(self) -> None:
        app = self.config.app
        server = getattr(getattr(app, "state", None), "server", None)
        if server is not None:
            self._shutdown_task = asyncio.ensure_future(server.lifecycle.abort_in_flight())
            self._shutdown_task.add_done_callback(lambda t: t.cancelled() or t.exception())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        _fail(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    refuse_routers(config)
    family = load_family(config.tokenizer, config.model_family, without_torch=True)

    from session_server.app import build_app
    from session_server.sessions.journal import JournalError

    try:
        app = build_app(config, family)
    except JournalError as exc:
        _fail(str(exc))
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=limited_httptools(config.max_header_bytes),  # httptools with a header-size limit (431)
        lifespan="on",
        workers=1,
        access_log=False,
        log_level=args.log_level,
        server_header=False,  # replies carry exactly one date header and no server header
        proxy_headers=False,  # nothing reads the client address: no X-Forwarded-* rewriting on every request
        date_header=True,
        backlog=4096,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=math.ceil(config.shutdown_timeout),  # uvicorn takes whole seconds
        h11_max_incomplete_event_size=config.max_header_bytes,
    )
    _Server(uv_config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
