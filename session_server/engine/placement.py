"""Placement over data-parallel engines: `--engine-url` given several times, one EngineClient per worker.

Why the server, not a router, owns placement: this server knows every session and every call that belongs to it;
SGLang's own `sglang-router` (0.3.2) does not. Measured with the real router in front of `sglang-sim` workers: it
answers 404 to `/abort_request`, `/open_session`, `/close_session`, `/pause_generation` and `/continue_generation`
(so an abort is a no-op, engine sessions cannot work, and KV is held until the connection drops), it rebuilds the
`/generate` body and drops `return_routed_experts`, and only `--policy manual` with `X-SMG-Routing-Key` keeps a
session on one worker. Here each session is placed on one worker when it first needs the engine -- the healthy worker
with the fewest live sessions, ties broken by the worker's load -- and every call of that session (`/generate`,
`/abort_request`, `open_session`/`close_session`) goes straight to that worker, so aborts, engine sessions and routed
experts keep working. The pool duck-types EngineClient's session-keyed API (the routing key *is* the session id), so
the chat handler and EngineSessions do not know whether there is one worker or many.

Health: a background probe (`--engine-health-interval`) asks each worker's cheap `GET /ready` (falling back to
`/health` where `/ready` is 404, e.g. a router) and its load (`GET /v1/loads`, SGLang 0.5.23; `GET /get_load` on
older engines and the router's view). A failing worker takes no new sessions; a transport failure on `/generate`
probes the worker at once, so a dead worker is noticed on the first failed turn rather than at the next tick. A
session whose worker is down moves on its next turn (`place`): the trajectory is re-prefilled on the new worker and
its engine session, if any, is reopened there (the old one died with its worker); moves are counted in /metrics.

Behind a router (engine/routers.py tells one from an engine), the features the router breaks are refused at startup
with an error that says why (`startup_refusal`); behind smg --enable-rl the control calls go through its fan-out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from session_server.engine.client import Answer, EngineClient, EngineReply, StreamedReply
from session_server.engine.http11 import IDLE_LIMIT
from session_server.engine.routers import EngineKind, classify, refusal
from session_server.engine.versions import DEFAULT_VERSION, cache_key
from session_server.errors import EngineUnavailableError

logger = logging.getLogger("session_server.engine.placement")

PROBE_TIMEOUT = 2.0


@dataclass(eq=False)
class Worker:
    """One engine URL and what the pool knows about it."""

    url: str
    client: EngineClient
    healthy: bool = True  # optimistic until the first probe: a fresh server must not refuse its first sessions
    sessions: int = 0  # live sessions placed here
    load: int = 0  # running + waiting requests at the last probe (tie-break only)
    kind: EngineKind | None = None  # an engine or a router (engine/routers.py); None until it first answers
    ready_path: str = "/ready"
    weight_version: str = DEFAULT_VERSION  # the weights it serves, as this server believes (engine/versions.py)
    # Per version, how many of its cache namespaces were found holding KV of other weights (engine/versions.py).
    key_generations: dict[str, int] = field(default_factory=dict)
    probing: asyncio.Task[None] | None = field(default=None, repr=False)
    # Its request rows (SGLang's --max-running-requests, from /server_info; None until known) and the engine
    # sessions open on it, each of which holds one row until closed (engine/sessions.py).
    max_running_requests: int | None = None
    rows_unsaid: bool = False  # its /server_info answered without them (a router): not asked again
    engine_sessions: int = 0
    asking_rows: asyncio.Future[int | None] | None = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "sessions": self.sessions, "load": self.load,
                "engine_sessions": self.engine_sessions, "max_running_requests": self.max_running_requests,
                "kind": str(self.kind) if self.kind is not None else None}


def max_running_requests(info: dict[str, Any]) -> int | None:
    """The request rows an engine runs at once, from its `/server_info`: SGLang 0.5.23's scheduler value
    (`internal_states[0].effective_max_running_requests_per_dp`), else the resolved `--max-running-requests`."""
    states = info.get("internal_states")
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    for value in (first.get("effective_max_running_requests_per_dp"), info.get("max_running_requests")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _total_load(body: Any) -> int | None:
    """Running + waiting requests from SGLang 0.5.23's `/v1/loads` ({"loads": [LoadSnapshot...]}), or `num_reqs`
    from the legacy `/get_load` list ([{"num_reqs", "num_waiting_reqs", "num_tokens"}] per DP rank)."""
    ranks = body.get("loads") if isinstance(body, dict) else body
    if not isinstance(ranks, list):
        return None
    total = 0
    for rank in ranks:
        if not isinstance(rank, dict):
            return None
        keys = ("num_running_reqs", "num_waiting_reqs") if "num_running_reqs" in rank else ("num_reqs",)
        for key in keys:
            value = rank.get(key, 0)
            if isinstance(value, int) and not isinstance(value, bool):
                total += value
    return total


class EnginePlacement:
    """The session-keyed engine API over one or more workers (see the module docstring)."""

    def __init__(
        self,
        clients: Iterable[EngineClient],
        *,
        health_interval: float = 5.0,
        probe_headers: dict[str, str] | None = None,
    ) -> None:
        self.workers = [Worker(c.base_url, c) for c in clients]
        if not self.workers:
            raise ValueError("an engine pool needs at least one engine URL")
        self.health_interval = health_interval
        self.moved = 0
        # Called with (session id, the worker it leaves) when a session moves: whoever keeps engine-side state of a
        # session on that worker (engine sessions) drops it there; the metrics count the move.
        self.on_move: list[Callable[[str, Worker], None]] = []
        self._placement: dict[str, Worker] = {}
        self._probe = httpx.AsyncClient(timeout=httpx.Timeout(PROBE_TIMEOUT), headers=probe_headers or {},
                                        limits=httpx.Limits(keepalive_expiry=IDLE_LIMIT))
        self._loop_task: asyncio.Task[Any] | None = None

    # -- placement ------------------------------------------------------------------------------------------
    def _healthy(self) -> list[Worker]:
        """The healthy workers, or all of them when none is (a call to one then says what is wrong)."""
        return [w for w in self.workers if w.healthy] or self.workers

    def _choose(self) -> Worker:
        return min(self._healthy(), key=lambda w: (w.sessions, w.load))

    def _assign(self, session_id: str, worker: Worker) -> None:
        old = self._placement.get(session_id)
        if old is worker:
            return
        if old is not None:
            old.sessions -= 1
        self._placement[session_id] = worker
        worker.sessions += 1

    def place(self, session_id: str) -> Worker:
        """The worker for this session's next turn: its own, or a new one if it has none or its worker is down.

        A move tells `on_move` (engine sessions forget the one that lived on the old worker: the next turn opens a
        fresh one on the new worker with the full prompt, which is exactly a re-prefill). Called at the start of every
        turn."""
        worker = self._placement.get(session_id)
        if worker is not None and (worker.healthy or not any(w.healthy for w in self.workers)):
            return worker
        new = self._choose()
        if worker is not None and new is not worker:
            self.moved += 1
            logger.warning("session %s moves from engine %s (unhealthy) to %s", session_id, worker.url, new.url)
            for listener in self.on_move:
                listener(session_id, worker)
        self._assign(session_id, new)
        return new

    def place_beside(self, session_ids: Iterable[str], holder: str) -> None:
        """Put `session_ids` on `holder`'s worker (placed now if it has none): a fork's children, whose shared prefix
        is in that worker's radix cache (a primed prompt's prefill, the parent's turns), not in another's."""
        worker = self.place(holder)
        for session_id in session_ids:
            self._assign(session_id, worker)

    def _client(self, session_id: str) -> Worker:
        worker = self._placement.get(session_id)
        if worker is None:  # a call before place() (e.g. close of a session that never chatted): place it now
            worker = self._choose()
            self._assign(session_id, worker)
        return worker

    def holders(self, routing_key: str | None) -> list[Worker]:
        """Where a call about a session's engine state goes: its worker, or every worker when it is not placed (only
        one can hold what the call names; the others answer that they do not know it)."""
        worker = self._placement.get(routing_key) if routing_key is not None else None
        return [worker] if worker is not None else self.workers

    def worker_of(self, session_id: str) -> Worker:
        """The session's worker (placed now if it has none)."""
        return self._client(session_id)

    async def rows_of(self, worker: Worker) -> int | None:
        """The worker's request rows (its /server_info, asked once; an unanswered ask is tried again on the next
        call), or None when it does not say."""
        if worker.max_running_requests is None and not worker.rows_unsaid:
            if worker.asking_rows is None or worker.asking_rows.done():
                worker.asking_rows = asyncio.ensure_future(self._ask_rows(worker))
            await asyncio.wait((worker.asking_rows,))
        return worker.max_running_requests

    async def _ask_rows(self, worker: Worker) -> int | None:
        info = await worker.client.server_info()
        rows = max_running_requests(info) if info is not None else None
        worker.rows_unsaid = info is not None and rows is None
        if rows is not None:
            worker.max_running_requests = rows
            logger.info("engine %s runs at most %d requests at once", worker.url, rows)
        return rows

    def forget(self, session_id: str) -> None:
        """The session is gone (DELETE, idle sweep): it no longer counts against its worker. Idempotent."""
        worker = self._placement.pop(session_id, None)
        if worker is not None:
            worker.sessions -= 1

    # -- the session-keyed engine API (EngineClient's, routed by session id) ---------------------------------
    async def generate(self, payload: bytes, routing_key: str) -> EngineReply:
        worker = self._client(routing_key)
        try:
            return await worker.client.generate(payload, routing_key)
        except EngineUnavailableError:
            self._probe_soon(worker)  # a dead worker is noticed on its first failed turn, not at the next tick
            raise

    @contextlib.asynccontextmanager
    async def stream_generate(self, payload: bytes, routing_key: str) -> AsyncIterator[StreamedReply]:
        """Streaming POST /generate on the session's worker (EngineClient.stream_generate)."""
        worker = self._client(routing_key)
        try:
            async with worker.client.stream_generate(payload, routing_key) as response:
                yield response
        except EngineUnavailableError:
            self._probe_soon(worker)
            raise

    async def abort(self, rid: str, routing_key: str | None = None) -> Answer:
        """Abort `rid` on the session's worker (on every worker when the session is unknown): DONE when a worker
        acknowledged it, else RETRY when one may later (no answer, 5xx), else REFUSED (e.g. a router's 404)."""
        # Each failure logs a warning.
        answers = set(await asyncio.gather(*(w.client.abort(rid) for w in self.holders(routing_key))))
        return next(a for a in (Answer.DONE, Answer.RETRY, Answer.REFUSED) if a in answers)

    async def pause_in_place(self) -> None:
        """SGLang's `/pause_generation` mode `in_place` on every worker: running requests keep their KV and resume,
        with the weights in place then, on `continue_in_place`. Nothing is paused when a router in front of the
        engines would not forward the call (EngineUnavailableError: 502, and why)."""
        blocked = [f"{w.url} is {w.kind}" for w in self.workers if w.kind in (EngineKind.SGLANG_ROUTER, EngineKind.SMG)]
        if blocked:
            raise EngineUnavailableError(
                f"pause in_place needs /pause_generation on the engines, and {'; '.join(blocked)}, which answers it "
                "404: start smg with --enable-rl (the server then pauses every engine through its fan-out)")
        await asyncio.gather(*(w.client.generation_control("/pause_generation", {"mode": "in_place"})
                               for w in self.workers))

    async def continue_in_place(self) -> None:
        await asyncio.gather(*(w.client.generation_control("/continue_generation", {}) for w in self.workers))

    async def pause_cutting(self, deadline: float) -> None:
        """SGLang's `/pause_generation` mode `abort` on every worker: every running request ends now with what it
        sampled (a continuable abort, turns/resume.py), and its turn goes on after the update under the new
        weights' cache key, re-prefilling prompt + partial reply (issue 38: exact across an update). Refused behind a
        router as `pause_in_place` is. `deadline`: seconds the engines may take (they answer once every running
        request has ended)."""
        blocked = [f"{w.url} is {w.kind}" for w in self.workers if w.kind in (EngineKind.SGLANG_ROUTER, EngineKind.SMG)]
        if blocked:
            raise EngineUnavailableError(
                f"a pause for a weight update needs /pause_generation on the engines, and {'; '.join(blocked)}, which "
                "answers it 404: start smg with --enable-rl (the server then pauses every engine through its fan-out)")
        await asyncio.gather(*(w.client.generation_control("/pause_generation", {"mode": "abort"}, deadline)
                               for w in self.workers))

    # -- weight versions (engine/versions.py) ---------------------------------------------------------------
    def version_of(self, routing_key: str) -> str:
        """The weights the session's worker serves, as this server believes."""
        return self._client(routing_key).weight_version

    def cache_key_of(self, routing_key: str, version: str) -> str:
        """The `extra_key` of a request for weights `version` on the session's worker."""
        return cache_key(version, self._client(routing_key).key_generations.get(version, 0))

    def distrust_key(self, routing_key: str, version: str, key: str) -> None:
        """A request sent under `key` for weights `version` was served by other weights, and the engine kept its KV
        under `key`: later requests for `version` use a fresh namespace (unless an earlier reply moved it already)."""
        worker = self._client(routing_key)
        generation = worker.key_generations.get(version, 0)
        if cache_key(version, generation) == key:
            logger.warning("engine %s: cache namespace %r holds KV of other weights; %r moves to a fresh one",
                           worker.url, key, version)
            worker.key_generations[version] = generation + 1

    def learn_version(self, routing_key: str, version: str) -> bool:
        """An engine reply named the weights of the session's worker; True when that is news."""
        worker = self._client(routing_key)
        if worker.weight_version == version:
            return False
        logger.warning("engine %s serves weights %r, not %r as believed", worker.url, version,
                       worker.weight_version)
        worker.weight_version = version
        return True

    async def learn_versions(self, version: str | None) -> bool:
        """After a push: every worker serves `version`, or (None) what its `/model_info` says (a worker that does not
        answer keeps its belief; its next reply corrects it). True when any belief changed."""
        if version is not None:
            found: list[str | None] = [version] * len(self.workers)
        else:
            found = list(await asyncio.gather(*(self._model_version(w) for w in self.workers)))
        changed = False
        for worker, new in zip(self.workers, found, strict=True):
            if new is not None and new != worker.weight_version:
                worker.weight_version, changed = new, True
        return changed

    async def refresh_version(self, routing_key: str) -> None:
        """Ask the session's worker what it serves now (`/model_info`): after the engine aborted every request,
        which a weight update the server was not told of does, before the turn goes on."""
        worker = self._client(routing_key)
        version = await self._model_version(worker)
        if version is not None:
            worker.weight_version = version

    async def _model_version(self, worker: Worker) -> str | None:
        try:
            body = (await self._get(worker, "/model_info")).json()
        except (httpx.HTTPError, ValueError):
            return None
        version = body.get("weight_version") if isinstance(body, dict) else None
        return version if isinstance(version, str) else None

    async def open_session(
        self, capacity_of_str_len: int, routing_key: str, idle_timeout: float | None = None,
        session_id: str | None = None, deadline: float | None = None,
    ) -> str:
        worker = self._client(routing_key)
        return await worker.client.open_session(capacity_of_str_len, routing_key, idle_timeout, session_id, deadline)

    async def close_session(self, sid: str, routing_key: str) -> bool:
        """Close on the session's worker; a session no longer placed (an orphaned open closed after DELETE) is
        closed on every worker, since only one can hold it and the others answer that it does not exist."""
        results = await asyncio.gather(*(w.client.close_session(sid, routing_key) for w in self.holders(routing_key)))
        return any(results)

    async def models(self) -> EngineReply:
        last: EngineUnavailableError | None = None
        for worker in self._healthy():
            try:
                return await worker.client.models()
            except EngineUnavailableError as exc:
                last = exc
        assert last is not None
        raise last

    async def server_info(self) -> dict[str, Any] | None:
        """The first answering worker's /server_info (data-parallel workers serve the same model and limits)."""
        for worker in sorted(self.workers, key=lambda w: not w.healthy):
            info = await worker.client.server_info()
            if info is not None:
                return info
        return None

    async def ready(self) -> bool:
        """Probe every worker now; True when at least one can take sessions."""
        await asyncio.gather(*(self.probe(w) for w in self.workers))
        return any(w.healthy for w in self.workers)

    def status(self) -> dict[str, Any]:
        healthy = sum(w.healthy for w in self.workers)
        state = "ready" if healthy == len(self.workers) else "degraded" if healthy else "engine_unavailable"
        return {"status": state, "engines": [w.describe() for w in self.workers]}

    # -- probing --------------------------------------------------------------------------------------------
    async def _get(self, worker: Worker, path: str) -> httpx.Response:
        return await self._probe.get(worker.url + path)

    async def probe(self, worker: Worker, *, load: bool = False) -> None:
        """Readiness (cheap GET /ready, /health where /ready is 404) of one worker, and its load when asked (the
        periodic probe, and only when there are workers to choose between); never raises."""
        try:
            resp = await self._get(worker, worker.ready_path)
            if resp.status_code == 404 and worker.ready_path == "/ready":
                worker.ready_path = "/health"
                resp = await self._get(worker, worker.ready_path)
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok != worker.healthy:
            log = logger.info if ok else logger.warning
            log("engine %s is %s", worker.url, "healthy again" if ok else "unhealthy: it takes no new sessions")
        worker.healthy = ok
        if ok and load and len(self.workers) > 1:
            current = await self._load(worker)
            if current is not None:
                worker.load = current

    async def _load(self, worker: Worker) -> int | None:
        for path in ("/v1/loads?include=core", "/get_load"):
            try:
                resp = await self._get(worker, path)
            except httpx.HTTPError:
                return None
            if resp.status_code == 200:
                try:
                    return _total_load(msgspec.json.decode(resp.content))
                except msgspec.DecodeError:
                    return None
        return None

    def _probe_soon(self, worker: Worker) -> None:
        if worker.probing is None or worker.probing.done():
            worker.probing = asyncio.ensure_future(self.probe(worker))

    async def _run(self) -> None:
        await self.classify()
        while True:
            await asyncio.sleep(self.health_interval)
            await self.classify()
            await asyncio.gather(*(self.probe(w, load=True) for w in self.workers))

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.ensure_future(self._run() if self.health_interval > 0 else self.classify())

    async def aclose(self) -> None:
        tasks = [t for t in (self._loop_task, *(w.probing for w in self.workers)) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(w.client.aclose() for w in self.workers))
        await self._probe.aclose()

    # -- routers --------------------------------------------------------------------------------------------
    async def classify(self) -> dict[str, EngineKind]:
        """Find out what stands at each worker URL not yet known (engine/routers.py) and switch a client behind smg
        --enable-rl to its fan-out; returns what is known. An unreachable URL stays unknown (logged) and is tried
        again by the periodic probe: the engines may come up later."""
        for worker in self.workers:
            if worker.kind is not None:
                continue
            try:
                worker.kind = await classify(self._probe, worker.url)
            except httpx.HTTPError as exc:
                logger.info("engine %s unreachable (%s): not yet known whether it is a router", worker.url, exc)
                continue
            worker.client.fan_out = worker.kind is EngineKind.SMG_RL
            if worker.kind.is_router:
                logger.info("engine URL %s is %s", worker.url, worker.kind)
        return {w.url: w.kind for w in self.workers if w.kind is not None}


CLASSIFY_BEFORE_SERVING = 2 * PROBE_TIMEOUT


async def classify_before_serving(pool: EnginePlacement) -> None:
    """Find out what stands at each engine URL before the first request is served (so a first abort already takes
    the right path), bounded: a URL that does not answer in time is asked again by the background probe."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CLASSIFY_BEFORE_SERVING):
            await pool.classify()


async def startup_refusal(pool: EnginePlacement, *, engine_sessions: bool, return_routed_experts: bool) -> str | None:
    """Run once before serving: the error to exit with when a router stands where an engine should and a flag needs
    what it breaks, else None. Closes the pool (it was built for this check only)."""
    try:
        if not (engine_sessions or return_routed_experts):
            return None
        kinds = await pool.classify()
    finally:
        await pool.aclose()
    return refusal(kinds, engine_sessions=engine_sessions, return_routed_experts=return_routed_experts)
