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
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn

from session_server.config import ADAPTER_REVISIONS, FORK_PREFILL_MODES, STALE_TURNS, STRADDLED_REPLIES, ServerConfig
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


# Each ServerConfig field's type, evaluated (config.py's annotations are strings): what a flag of that name parses to.
_FIELD_TYPES: dict[str, Any] = typing.get_type_hints(ServerConfig)
_FROM_CONFIG: Any = object()  # a Flag's default: the ServerConfig field's


@dataclasses.dataclass(frozen=True)
class Flag:
    """One row of the flag table: the option and its help, as `--help` prints them, plus what argparse needs that the
    configuration cannot say (choices, a metavar, an action). The rest comes from the ServerConfig field of the same
    name (dashes for underscores), so it is written once, in config.py: the default, the type (int and float fields
    parse as such, a bool field is a switch), and required when the field has no default. `default` is for a flag
    with no field (--log-level) or one whose default is read elsewhere (a key from the environment)."""

    option: str
    help: str
    choices: Sequence[str] | None = None
    metavar: str | None = None
    action: type[argparse.Action] | None = None
    default: Any = _FROM_CONFIG

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")

    def argparse_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"help": self.help}
        for name in ("choices", "metavar", "action"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        field = ServerConfig.__dataclass_fields__.get(self.dest)
        if self.default is not _FROM_CONFIG or field is None:
            kw["default"] = None if self.default is _FROM_CONFIG else self.default
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = _default(self.dest)
        kind = _FIELD_TYPES.get(self.dest)
        if kind is bool:
            kw["action"] = "store_true"
        elif kind in (int, float):
            kw["type"] = kind
        elif kind == int | None:  # an int flag whose absence means "derive it" (e.g. from the engine)
            kw["type"] = int
        return kw


def flags() -> tuple[Flag, ...]:
    """The flags in `--help` order. Built per call: help lists the families registered now, and the engine keys'
    defaults are read from the environment when the parser is built."""
    return (
        Flag("--engine-url", "SGLang engine base URL (native API), e.g. http://127.0.0.1:30000; repeat it for "
             "data-parallel workers (the server places each session on one; give the engines themselves, not a router "
             "in front of them)", action=_EngineUrls),
        Flag("--engine-health-interval", "seconds between readiness/load probes of each engine (GET /ready, "
             "/v1/loads); an engine that fails takes no new sessions and its sessions move on their next turn; 0 = "
             "probe only on /ready and failures (default %(default)s)"),
        Flag("--tokenizer", "Hugging Face tokenizer directory (loaded with AutoTokenizer)"),
        Flag("--model-family", f"model family, one of: {', '.join(family_names())}", metavar="NAME"),
        Flag("--host", "address to listen on (default %(default)s)"),
        Flag("--port", "port to listen on; 0 picks a free one (default %(default)s)"),
        Flag("--cpu-workers", "threads for stateless CPU work (decode/encode/serialize); default min(16, cores)"),
        Flag("--max-rollback", "checkpoints a diverging request may drop (default %(default)s)"),
        Flag("--on-divergence", "a request whose history extends no segment of its session within --max-rollback (a "
             "compaction, a sub-agent, a side request): 'segment' starts a new segment of the session, 'reject' is a "
             "400 (default %(default)s)", choices=DIVERGENCE_POLICIES),
        Flag("--max-segments", "segments one session may hold; a request that would start one more gets 400 (default "
             "%(default)s)"),
        Flag("--merge-segments", "continue a segment instead of starting one when the new history's full render "
             "extends every token of it (one sample per episode where the tokens allow it)"),
        Flag("--engine-sessions", "one SGLang streaming session per trajectory, opened at its second turn (the first "
             "has nothing to reuse); later turns send only new tokens (engine: streaming sessions on)"),
        Flag("--max-engine-sessions-per-engine", "engine sessions open at once on one engine: each holds one of its "
             "--max-running-requests rows until closed, so a turn past this goes without one (counted) and a later "
             "turn tries again (default: the engine's max_running_requests from /server_info less a quarter; 0 = no "
             "cap)", metavar="N"),
        Flag("--request-timeout", "seconds an engine call may take before it is aborted and the chat gets 504 "
             "(default %(default)s)"),
        Flag("--max-turn-continuations", "times a turn goes on after the engine aborted every in-flight request (a "
             "weight update): prompt + the tokens sampled so far are resubmitted and the agent sees one reply; past it "
             "the turn is a 503 to retry; 0 never continues (default %(default)s)"),
        Flag("--straddled-replies", "a reply running while new weights are pushed (POST /admin/pause in_place): "
             "'recompute' cuts it and continues it under the new weights and their cache key, so every token is the "
             "new weights' on their own KV; 'keep' lets it run on in place, its later tokens marked in the sample's "
             "weight-version spans (default %(default)s)", choices=STRADDLED_REPLIES),
        Flag("--max-staleness", "weight versions a turn may fall behind at a push before it is sampled again from its "
             "prompt (see --stale-turns); -1: no bound (default %(default)s)"),
        Flag("--stale-turns", "a turn past --max-staleness: 'regenerate' samples it again under the new weights (the "
             "agent sees one reply, later), 'refuse' answers 503 + Retry-After (default %(default)s)",
             choices=STALE_TURNS),
        Flag("--lora-adapter", "the LoRA adapter (as the engine names it: --lora-paths NAME=DIR) that samples every "
             "session that names none (POST /sessions metadata 'lora_adapter', or a model field 'base:NAME'); the "
             "engine must hold it at startup (default: the base model)", metavar="NAME"),
        Flag("--adapter-revisions", "a session's LoRA adapter after a trainer pushed a new revision: 'pinned' keeps "
             "the revision it began with until it ends, 'latest' takes the newest at each next turn (default "
             "%(default)s)", choices=ADAPTER_REVISIONS),
        Flag("--keep-adapter-revisions", "never unload a LoRA adapter revision a newer one superseded (by default the "
             "server unloads it once none of its sessions holds it); for several servers in front of one engine, "
             "where each knows only its own sessions"),
        Flag("--max-request-bytes", "largest accepted request body in bytes; larger ones get 413 (default "
             "%(default)s)"),
        Flag("--max-images", "images per request"),
        Flag("--max-image-bytes", "bytes per encoded image"),
        Flag("--max-image-pixels", "pixels per image"),
        Flag("--fetch-images", "fetch http(s) image URLs (else data URLs only)"),
        Flag("--image-fetch-timeout", "seconds a fetch"),
        Flag("--max-metadata-bytes", "largest session metadata (POST /sessions, JSON-encoded bytes); larger gets 413 "
             "(default %(default)s)"),
        Flag("--body-timeout", "seconds a request body may take to arrive in full, on every route; slower uploads get "
             "408 (default %(default)s)"),
        Flag("--max-header-bytes", "largest request line + headers of one request; larger gets 431 and the connection "
             "is closed (default %(default)s)"),
        Flag("--max-fork", "children one POST /sessions/{id}/fork may create; more is a 400 and nothing is created "
             "(default %(default)s)"),
        Flag("--fork-prefill", "engine: what a fork's children share is prefilled by the engine once (max_new_tokens "
             "0) before the fork or prime answers -- a primed prompt, and with --engine-sessions a forked history "
             "that the parent's engine session holds outside the radix cache -- so their turns find it cached "
             "whatever their order; off: each child prefills it (default %(default)s)", choices=FORK_PREFILL_MODES),
        Flag("--max-sessions", "live sessions the server holds; POST /sessions (and on-demand creation) beyond gets "
             "503 with Retry-After (a fork whose children do not fit: 429); 0 = unbounded (default %(default)s)"),
        Flag("--max-session-tokens", "tokens one session may hold (prompt + completion): a turn whose prompt reaches "
             "it is a 400, and generation is capped to what is left; 0 = unbounded (default %(default)s)"),
        Flag("--drain-timeout", "POST /admin/pause (drain) waits this many seconds for running chats, then aborts the "
             "rest (they get 503 + Retry-After), so a weight update can always proceed (default %(default)s)"),
        Flag("--shutdown-timeout", "on SIGTERM, seconds to wait for open connections (e.g. a half-sent body) before "
             "closing them (default %(default)s)"),
        Flag("--special-tokens-in-content", "text (default): spellings of control tokens inside message text, tool "
             "arguments and schemas are tokenized as plain text, so no message can forge chat structure; engine: they "
             "become the control tokens, as the engine's own chat endpoint does", choices=SPECIAL_TOKEN_MODES),
        Flag("--message-matcher", "how history is matched: loose_tool_call (default: tool-call arguments that are "
             "equal as JSON match, as agents re-serialise them) or strict (argument text byte for byte; any "
             "re-serialisation rolls back)", choices=MATCHERS),
        Flag("--engine-incremental-streaming", "the engine runs with SGLang's --incremental-streaming-output (stream "
             "events are deltas); default: SGLang's cumulative events"),
        Flag("--stream-coalesce-ms", "a streamed chat reads the engine at most once per this many milliseconds after "
             "its first chunk, and sends what arrived meanwhile as one chunk: with one engine event per token "
             "(SGLang's stream_interval 1), each event on its own costs ~20 us of server CPU, 30x an unstreamed token; "
             "0 = every event as it arrives (default %(default)s)"),
        Flag("--stream-chunk-ms", "a streamed chat's text reaches the agent in chunks: the first at once, then what "
             "arrived every this many milliseconds (a gap between two chunks is at most this plus one engine event), "
             "0 = what each read brings; fewer chunks cost less server CPU (default %(default)s, engine/pacing.py)"),
        Flag("--stream-chunk-tokens", "... or as soon as this many tokens are held, whichever comes first; what "
             "arrives faster goes out in chunks of this many tokens, several in one write (default %(default)s: "
             "above what a GPU decodes for one request within --stream-chunk-ms)"),
        Flag("--engine-stream-interval",
             "tokens per engine stream event asked for (SGLang's per-request stream_interval; the first token always "
             f"comes at once). 0 (default) chooses: {pacing.DELTA_INTERVAL} when the engine streams deltas; with "
             "cumulative events (each holds the whole reply so far) one per "
             f"max_tokens/{pacing.CUMULATIVE_EVENTS} tokens, so a streamed reply stays linear (engine/pacing.py)"),
        Flag("--create-sessions-on-demand", "a chat at the root URL (POST /v1/chat/completions) whose X-Session-ID "
             "names no session creates it (ids: 1-128 characters of A-Z a-z 0-9 . _ : -); the client then chooses the "
             "id, so it is not a secret"),
        Flag("--session-idle-timeout", "delete a session (like DELETE) after this many seconds without a request; a "
             "chat in flight counts as activity until it outlives --request-timeout; 0 = never (default %(default)s)"),
        Flag("--tombstones", "ids of deleted sessions remembered so late requests get 'was deleted'; oldest forgotten "
             "first (default %(default)s, about 200 bytes each)"),
        Flag("--admin-token", "if set, /admin/* and the viewer (/view/) require 'Authorization: Bearer TOKEN'"),
        Flag("--otlp-endpoint", "export an OpenTelemetry span per turn and per pause/continue to this OTLP/HTTP "
             "collector (e.g. http://127.0.0.1:4318), each a child of the agent's traceparent, and pass the turn's "
             "traceparent to the engine (needs the extra 'trace'); default: no tracing", metavar="URL"),
        Flag("--inline-below-bytes", "bodies smaller than this are parsed on the event loop, larger ones on the CPU "
             "pool (a pool hop costs more than a small decode); 0 pools everything (default %(default)s)"),
        Flag("--first-turn-cache-tokens", "token ids of first turns kept by their exact request (messages, tools, "
             "template kwargs), so the G samples of a GRPO group render their shared first request once; least "
             "recently used out first, 0 keeps none (default %(default)s, 4 bytes each)"),
        Flag("--inline-decode", "decode engine responses on the event loop instead of the CPU pool (for benchmarks)"),
        Flag("--return-routed-experts", "ask the engine for routed experts (MoE routing replay); kept raw in the "
             "records, never sent to agents"),
        Flag("--return-sampling-masks", "ask the engine for the sampling masks of every session (the ids top-k / "
             "top-p / min-p kept for each sampled token, so a trainer can renormalise over them); a session may set "
             "return_sampling_masks at POST /sessions instead. Requests that cannot be replayed exactly are refused "
             "(docs/operating.md)"),
        Flag("--sampling-mask-top-k", "with sampling masks: the top_k a request gets when it names none (0, the "
             "default: such a request is a 400; SGLang records masks only under a top-k bound)", metavar="K"),
        Flag("--sampling-mask-max-tokens", "the engine's --sampling-mask-max-tokens: a request with a larger top_k is "
             "a 400 on a session with masks (default %(default)s)", metavar="N"),
        Flag("--return-token-ids", "put the turn's token ids on every Chat and Responses reply (vLLM's "
             "prompt_token_ids and token_ids; NeMo Gym's fields on Responses items), as a request's own "
             "`return_token_ids: true` does"),
        Flag("--engine-client", "client for the hot POST /generate: the lean httptools pool (default) or httpx, to "
             "measure against it", choices=ENGINE_CLIENTS),
        Flag("--engine-api-key",
             f"the engine's --api-key, sent as a Bearer token on /generate and session calls "
             f"(default: ${ENGINE_API_KEY_ENV}; never logged)", default=os.environ.get(ENGINE_API_KEY_ENV) or None),
        Flag("--engine-admin-api-key",
             f"the engine's --admin-api-key, sent on abort/pause/flush calls (default: ${ENGINE_ADMIN_API_KEY_ENV}; "
             "never logged)", default=os.environ.get(ENGINE_ADMIN_API_KEY_ENV) or None),
        Flag("--engine-control-timeout", "deadline in seconds of each engine control call (abort, open/close session, "
             "ready) (default %(default)s)"),
        Flag("--abort-grace", "seconds an acknowledged abort may take to end the engine request before the server "
             "closes its connection (default %(default)s)"),
        Flag("--journal", "keep every session, committed turn and deletion in this SQLite file (WAL); a restart on "
             "the same file restores the sessions. A turn is on disk before its reply is sent. Default: memory only",
             metavar="PATH"),
        Flag("--journal-sync", "normal: a replied turn survives the server process being killed (SIGKILL, OOM), not a "
             "power loss or kernel crash; full: fsync on every group commit, survives those too, at more latency per "
             "turn (default normal)", choices=SYNC_MODES),
        Flag("--replica-name", "this replica's name behind a load balancer (a-z 0-9 -): the session ids it mints "
             "start with 'NAME.', and the balancer's config (python -m deploy.nginx) routes them back to it; keep it "
             "across restarts", metavar="NAME"),
        Flag("--log-level", "log level", choices=("debug", "info", "warning", "error"), default="warning"),
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Token-in-token-out session server between OpenAI-chat agents and SGLang.")
    for flag in flags():
        p.add_argument(flag.option, **flag.argparse_kwargs())
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
