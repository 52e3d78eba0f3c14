"""build_app(config, family): the route table of docs/design.md 3 and the lifespan that owns the shared objects.

Only these paths exist; everything else -- in particular any engine path under a session URL -- is a JSON 404, so a
session URL handed to an agent grants chat, samples and the model list, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import Route

from session_server.api import admin, forks, primes, samples, sessions
from session_server.chat import routes as chat
from session_server.config import ServerConfig
from session_server.cpu_pool import CpuPool
from session_server.engine.adapters import AdapterBook
from session_server.engine.client import EngineClient
from session_server.engine.drains import EngineDrains
from session_server.engine.placement import EnginePlacement, classify_before_serving
from session_server.engine.sessions import EngineSessions
from session_server.errors import method_not_allowed, not_found
from session_server.http.front_door import FrontDoorApp
from session_server.messages import routes as messages
from session_server.metrics import LoopLagTicker, Metrics
from session_server.responses import routes as responses
from session_server.sessions.journal import Journal, JournalError, Restored
from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.recovery import restore_sessions
from session_server.sessions.registry import Registry
from session_server.sessions.sweeper import Sweeper
from session_server.state import ServerState
from session_server.tracing import Tracer
from session_server.turns.limits import learn_prompt_limit
from session_server.view import routes as view
from trajectory import ModelFamily

logger = logging.getLogger("session_server")


CLOSE_WAIT_FACTOR = 3  # a shutdown waits this many control timeouts at most for the engine sessions being closed


def build_state(config: ServerConfig, family: ModelFamily, journaled: JournalOpened | None = None) -> ServerState:
    registry = Registry(config.tombstones, id_prefix=config.session_id_prefix)
    engine = build_engines(config)
    metrics = Metrics()
    family.first_turns.resize(config.first_turn_cache_tokens)
    journal = journaled[0] if journaled is not None else None
    engine_sessions = (EngineSessions(
        engine, config.session_idle_timeout, metrics, config.request_timeout,
        on_opening=journal.engine_session_opening if journal is not None else None,
        on_gone=journal.engine_session_gone if journal is not None else None,
        max_per_engine=config.max_engine_sessions_per_engine,
    ) if config.engine_sessions else None)
    drains = EngineDrains(engine, metrics, config.abort_grace, horizon=config.request_timeout)
    server = ServerState(
        config=config,
        family=family,
        registry=registry,
        lifecycle=Lifecycle(
            registry, retry_after=config.retry_after, metrics=metrics, engine_sessions=engine_sessions,
            journal=journal, drains=drains, drain_wait=config.engine_control_timeout,
            max_sessions=config.max_sessions,
            engines=engine, cut_replies=config.straddled_replies == "recompute",
        ),
        engine=engine,
        pool=CpuPool(config.cpu_workers, inline_decode=config.inline_decode,
                     inline_below_bytes=config.inline_below_bytes),
        engine_sessions=engine_sessions,
        metrics=metrics,
        journal=journal,
        drains=drains,
    )
    if journaled is not None:
        restored = restore_sessions(server.registry, server.family, journaled[1], server.new_segments,
                                    primes.primer(server))
        if restored:
            logger.warning("restored %d sessions from journal %s", restored, config.journal)
        if journaled[1].paused is not None:  # restarted during a pause: keep refusing chats until /admin/continue
            server.lifecycle.pause.restore(journaled[1].paused)
            logger.warning("paused (mode %s) as journal %s says: POST /admin/continue resumes", journaled[1].paused,
                           config.journal)
    engine.on_move.append(lambda _session_id, _worker: metrics.sessions_moved.inc())
    server.adapters = AdapterBook(engine, follow=config.adapter_revisions, default=config.lora_adapter,
                                  unload=not config.keep_adapter_revisions)
    server.lifecycle.on_close.append(server.adapters.release)
    if config.otlp_endpoint is not None:
        replica = {"session_server.replica": config.replica_name} if config.replica_name else {}
        server.tracer = Tracer(config.otlp_endpoint, attributes={"service.instance.id": server.instance_id, **replica})
    for worker in engine.workers:
        worker.client.on_control_failure = lambda path, kind: metrics.engine_control_failures.labels(path, kind).inc()
    watch_state(server)
    return server


def close_stale_engine_sessions(server: ServerState, stale: list[tuple[str, str]]) -> None:
    """The engine sessions a killed predecessor left open (the journal's book, engine/sessions.py) are closed now,
    not at the engine's idle timeout."""
    if not stale:
        return
    if server.engine_sessions is None:
        logger.warning("journal lists %d engine sessions a previous run may have left open; without "
                       "--engine-sessions they are left to the engine's idle timeout", len(stale))
        return
    logger.warning("closing %d engine sessions a previous run left open (journal %s)", len(stale),
                   server.config.journal)
    server.engine_sessions.close_stale(stale)


JournalOpened = tuple[Journal, Restored]


def open_journal(config: ServerConfig, family: ModelFamily) -> JournalOpened | None:
    """Open and read --journal before serving; a file we must not read raises JournalError (the CLI exits 2)."""
    if config.journal is None:
        return None
    journal = Journal(config.journal, sync=config.journal_sync, max_tombstones=config.tombstones)
    restored = journal.open()
    families = {s.family for s in restored.sessions} - {family.name}
    if families:
        raise JournalError(
            f"journal {config.journal} holds sessions of model family {', '.join(sorted(families))} but the server "
            f"runs {family.name!r}: start with that family or another --journal"
        )
    return journal, restored


def build_engines(config: ServerConfig) -> EnginePlacement:
    """One EngineClient per --engine-url, behind the placement pool (engine/placement.py)."""
    clients = [
        EngineClient(
            url, timeout=config.request_timeout, connections=config.engine_connections,
            hot_path=config.engine_client,
            api_key=config.engine_api_key, admin_api_key=config.engine_admin_api_key,
            control_timeout=config.engine_control_timeout,
        )
        for url in config.engine_bases
    ]
    # /ready and /health need no key; /v1/loads and /get_server_info are SGLang NORMAL endpoints (the api key).
    probe_headers = {"Authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else None
    return EnginePlacement(clients, health_interval=config.engine_health_interval, probe_headers=probe_headers)


def watch_state(server: ServerState) -> None:
    """Gauges of live state, read when /metrics is scraped (nothing on the hot path updates them)."""
    lifecycle, registry, watch = server.lifecycle, server.registry, server.metrics.watch
    watch("in_flight", "chats in flight", lambda: lifecycle.in_flight)
    watch("in_flight_at_engine", "chats in flight whose request reached the engine", lambda: lifecycle.at_engine)
    watch("sessions", "live sessions", lambda: len(registry))
    watch("tombstones", "deleted session ids remembered", lambda: registry.num_tombstones)
    watch("paused", "1 while /admin/pause holds new chats", lambda: int(lifecycle.paused))
    config = server.config
    watch("max_sessions", "--max-sessions (0: unbounded)", lambda: config.max_sessions)
    watch("max_session_tokens", "--max-session-tokens (0: unbounded)", lambda: config.max_session_tokens)
    journal = server.journal
    watch("journal_queue_depth", "journal writes queued or being written (0 without --journal)",
          lambda: journal.queue_depth if journal is not None else 0)
    drains, engine_sessions = server.drains, server.engine_sessions
    watch("engine_retries_pending", "failed engine control calls (aborts, closes) being retried in the background",
          lambda: (drains.retries_pending if drains is not None else 0)
          + (engine_sessions.closes_pending if engine_sessions is not None else 0))
    watch("engine_session_closes_under_way", "engine sessions being closed in the background (DELETE's closes not "
          "yet answered, failed ones being retried)",
          lambda: engine_sessions.closes_under_way if engine_sessions is not None else 0)
    first_turns, watch_count = server.family.first_turns, server.metrics.watch_count
    watch_count("first_turn_cache_hits", "first turns whose prompt ids came from the first-turn cache (the repeats "
                "of a GRPO group's shared first request)", lambda: first_turns.hits)
    watch_count("first_turn_cache_misses", "first turns rendered and tokenized (the cache on, not holding them)",
                lambda: first_turns.misses)
    repeats = server.first_turn_repeats
    watch_count("first_turns_on_loop", "repeated first requests whose kept ids were served on the event loop, "
                "without the CPU pool's hop (repeated_first_turns.py)", lambda: repeats.on_loop)
    watch("first_turn_cache_tokens", "token ids the first-turn cache holds (--first-turn-cache-tokens bounds them)",
          lambda: first_turns.tokens)
    workers = server.engine.workers
    watch("engines", "engine workers configured (--engine-url)", lambda: len(workers))
    watch("engines_healthy", "engine workers passing their health checks", lambda: sum(w.healthy for w in workers))


async def shutdown(server: ServerState) -> None:
    await server.lifecycle.shutdown()
    if server.drains is not None:
        await server.drains.wait_all()  # every engine abort sent (each drain is bounded) before the client closes
        await server.drains.aclose()  # unanswered aborts stop being retried: their connections close
    if server.engine_sessions is not None:
        # DELETE's closes still under way (each first waits for its abort, then one bounded call), and the failed
        # ones being retried for as long: what is left then is the engine's idle timeout's to close.
        await server.engine_sessions.wait_closes(CLOSE_WAIT_FACTOR * server.config.engine_control_timeout)
        await server.engine_sessions.aclose()
    if server.adapters is not None:
        await server.adapters.aclose()  # unloads under way end before the engine client closes
    await server.engine.aclose()
    server.pool.shutdown()
    if server.journal is not None:
        await server.journal.close()
    if server.tracer is not None:
        await asyncio.to_thread(server.tracer.shutdown)  # the spans still queued are exported


def freeze_startup_heap() -> None:
    """Move everything allocated so far (the tokenizer, transformers, numpy: millions of objects) out of the GC's
    reach. Otherwise each full collection walks it all and stalls the event loop for 50-140 ms under load (measured
    with gc.callbacks during the responsiveness benchmark); these objects live as long as the process anyway."""
    gc.collect()
    gc.freeze()


def build_app(config: ServerConfig, family: ModelFamily) -> Starlette:
    journaled = open_journal(config, family)  # before serving: a journal we cannot read stops the start

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            server = build_state(config, family, journaled)
        except BaseException:
            if journaled is not None:
                await journaled[0].close()
            raise
        app.state.server = server
        if server.journal is not None:
            server.journal.start()
            assert journaled is not None
            close_stale_engine_sessions(server, journaled[1].engine_sessions)
        freeze_startup_heap()
        sweeper = Sweeper(server.lifecycle, server.config.session_idle_timeout, server.config.request_timeout)
        sweeper.start()
        lag = LoopLagTicker(server.metrics)
        lag.start()
        limit_task = asyncio.ensure_future(learn_prompt_limit(server))
        await classify_before_serving(server.engine)
        assert server.adapters is not None
        await server.adapters.startup()  # the engines' LoRA adapters; a --lora-adapter they lack stops the start
        server.engine.start()
        try:
            yield
        finally:
            limit_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await limit_task
            await lag.stop()
            await sweeper.stop()
            await shutdown(server)

    session = "/sessions/{session_id}"
    chat_route = Route(session + "/v1/chat/completions", chat.create, methods=["POST"])
    # First match wins and every request tries the routes in order, so the busiest come first (chats take the lane).
    routes = [
        Route("/health", admin.health, methods=["GET"]),
        Route("/sessions", sessions.create_session, methods=["POST"]),
        Route(session, sessions.delete_session, methods=["DELETE"]),
        chat_route,
        Route(session + "/v1/responses", responses.create, methods=["POST"]),
        Route(session + "/v1/messages", messages.create, methods=["POST"]),
        Route(session + "/samples", samples.collect_samples, methods=["POST"]),
        Route(session + "/fork", forks.fork_session, methods=["POST"]),
        Route(session + "/prime", primes.prime_session, methods=["POST"]),
        Route(session, sessions.get_session, methods=["GET"]),
        # One base URL for many episodes, addressed by the X-Session-ID header (frontend/root_session.py).
        Route("/v1/chat/completions", chat.create_at_root, methods=["POST"]),
        Route("/v1/responses", responses.create_at_root, methods=["POST"]),
        Route("/v1/messages", messages.create_at_root, methods=["POST"]),
        Route(session + "/v1/messages/count_tokens", messages.count, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_at_root, methods=["POST"]),
        Route(session + "/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.retrieve_at_root, methods=["GET"]),
        Route("/ready", admin.ready, methods=["GET"]),
        Route("/metrics", admin.metrics, methods=["GET"]),
        Route(session + "/v1/models", sessions.list_models, methods=["GET"]),
        Route(session + "/v1/models/{model_id:path}", sessions.retrieve_model, methods=["GET"]),
        Route("/v1/models", sessions.list_models_at_root, methods=["GET"]),
        Route("/admin/pause", admin.pause, methods=["POST"]),
        Route("/admin/continue", admin.resume, methods=["POST"]),
        Route("/admin/sessions", admin.sessions, methods=["GET"]),
        # The read-only trajectory viewer (view/routes.py, docs/viewer.md): last, it is the least busy.
        Route("/view/", view.list_page, methods=["GET"]),
        Route("/view/api/sessions", view.sessions_json, methods=["GET"]),
        Route("/view/sessions/{session_id}", view.session_page, methods=["GET"]),
        Route("/view/api/sessions/{session_id}", view.session_json, methods=["GET"]),
    ]
    app = FrontDoorApp(
        routes=routes,
        # One layer (http/front_door.py) counts every response once, answers an unhandled error with one logged
        # JSON 500, and takes chats past the router.
        chat_route=chat_route,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: method_not_allowed},
    )
    # No trailing-slash redirect: Starlette would answer `POST /sessions/` with a 307 to a URL built from the
    # client's Host header. Unknown paths are a JSON 404, like any other.
    app.router.redirect_slashes = False
    return app
