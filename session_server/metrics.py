"""What an operator scrapes at GET /metrics: prometheus_client metrics in a registry owned by one app.

One registry per app (not the library's global one), so several apps can live in one test process and each /metrics
shows only its own server. Every metric is created here, once, with bounded label values: a route label is the
route's template (`/sessions/{session_id}`), never the raw path, so a million sessions do not make a million series.

How code counts things: through the `Metrics` object on the server state, e.g.
`server.metrics.rollback("diverged")`, `server.metrics.validation_failure(err.rule)`,
`server.metrics.abort(AbortReason.DISCONNECT)`, `server.metrics.stage("commit", seconds)`. Responses are counted in
exactly one place, http/front_door.py (the one ASGI layer every request passes): every response once, by route
template, method and status, including the 500 of an unhandled exception and the 404/405 of paths no route knows.

Cost on the hot path: children of labelled metrics are resolved once and cached in plain dicts (`labels()` takes a
lock and builds a tuple on every call). What every turn counts (its response, tokens, stage and latency histograms)
is tallied in plain Python numbers (`Tally`, `HistogramTally`: an add, a C bisect; no lock, no Python loop over
the buckets) and written into the prometheus_client children whenever the registry is collected, so a scrape (or
any reader of the registry) sees exactly what the children would hold had each count gone to them directly; the
tallies are updated and folded on the event loop only, and a child with a tally counts only through it. The rest
-- rare events -- counts on the children as usual.
Gauges of live state (sessions, in-flight chats, pause, journal queue) are read at scrape time by callbacks, so
nothing on the hot path updates them. Event-loop lag is measured by a ticker (`LoopLagTicker`) that asks to be run
every `interval` seconds and records how late the loop ran it: a saturated loop shows up here before the agents
time out.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.gc_collector import GCCollector

from session_server.errors import AbortReason
from trajectory.messages import ROLLBACK_REASONS
from trajectory.session_segments import SEGMENT_REASONS

# `<name>_created` timestamp series double the output and nobody graphs them (process-wide switch, set once).
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

PREFIX = "session_server"

# Seconds. Chats wait for generation (up to the request timeout); the server's own work is sub-millisecond to tens of
# milliseconds; the loop lag of a healthy server is well below a millisecond.
CHAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CPU_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

STAGES = ("prepare", "decode", "commit", "journal")
TOKEN_KINDS = ("prompt", "cached", "completion")
LIMITS = ("sessions", "session_tokens", "context")
CONTINUATION_RESULTS = ("continued", "limit", "constrained", "budget", "foreign", "recomputed", "regenerated", "stale")


class Tally:
    """A counter child's count, kept as a plain number (see the module docstring)."""

    __slots__ = ("_child", "_total")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._total = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._total += amount

    def fold(self) -> None:
        self._child._value.set(self._total)


class HistogramTally:
    """A histogram child's buckets and sum, kept as plain numbers (see the module docstring). The bucket of an
    observation is the first whose bound it does not exceed, as `Histogram.observe` picks it."""

    __slots__ = ("_bounds", "_child", "_counts", "_sum")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._bounds: list[float] = list(child._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._sum += amount
        i = bisect.bisect_left(self._bounds, amount)
        if i < len(self._bounds) and amount <= self._bounds[i]:  # NaN lands in no bucket, as in Histogram.observe
            self._counts[i] += 1

    def fold(self) -> None:
        child = self._child
        child._sum.set(self._sum)
        for bucket, count in zip(child._buckets, self._counts, strict=True):
            bucket.set(float(count))


class _ReadCounter:
    """A counter read from its owner at collection time (`Metrics.watch_count`)."""

    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._name, self._doc, self._read = name, doc, read

    def describe(self) -> list[Any]:
        return [CounterMetricFamily(self._name, self._doc)]

    def collect(self) -> Iterator[Any]:
        yield CounterMetricFamily(self._name, self._doc, value=self._read())


class _Folder:
    """Registered first in the registry: every collection folds the tallies into their children before any metric
    is read. It yields no metric of its own."""

    def __init__(self, tallies: list[Tally | HistogramTally]) -> None:
        self._tallies = tallies

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        for tally in self._tallies:
            tally.fold()
        yield from ()


class Metrics:
    """All of one server's metrics, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._tallies: list[Tally | HistogramTally] = []
        self.registry.register(_Folder(self._tallies))
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=r)

        self.responses = counter(
            "responses", "HTTP responses by route template, method and status", ("route", "method", "status")
        )
        self.chat_seconds = histogram(
            "chat_seconds", "latency of successful chats, from the slot claim to the reply", CHAT_BUCKETS
        )
        self.engine_seconds = histogram(
            "engine_seconds", "latency of engine /generate calls, response read included", CHAT_BUCKETS
        )
        self.added_seconds = histogram(
            "added_seconds", "what the server adds to a successful chat: chat latency minus engine latency", CPU_BUCKETS
        )
        self.stage_seconds = histogram(
            "stage_seconds",
            "time in a stage of a chat: prepare (parse + TITO + encode), decode (engine response), commit, journal "
            "(waiting for the turn's journal write)",
            CPU_BUCKETS, ("stage",),
        )
        self.tokens = counter(
            "tokens", "tokens of committed turns: prompt, cached (prefix hits), completion", ("kind",)
        )
        self.rollbacks = counter("rollbacks", "turns committed after rolling back history, by reason", ("reason",))
        self.segments_started = counter(
            "segments_started", "segments started by a history that extends none (compaction, sub-agent, side "
            "request), by reason", ("reason",))
        self.validation_failures = counter(
            "engine_validation_failures", "engine responses refused (502), by the rule they broke", ("rule",)
        )
        self.aborts = counter("aborts", "chats aborted before commit, by cause", ("cause",))
        self.engine_aborts = counter("engine_aborts", "abort_request calls sent to the engine")
        self.continuations = counter(
            "turn_continuations", "engine aborts of a turn for every in-flight request (a weight update), by what "
            "followed: continued (prompt + the tokens sampled so far resubmitted), or the 503 the agent got instead: "
            "limit (--max-turn-continuations reached), constrained (a grammar would restart), budget (no tokens "
            "left), foreign (an abort with a reason of its own); issue 38: recomputed (tokens the weights of the "
            "request's cache key did not sample, cut off and sampled again), regenerated (a turn past --max-staleness "
            "sampled again from its prompt), stale (one refused instead), streamed (a streamed reply whose streamed "
            "tokens were of other weights: the 503)", ("result",),
        )
        self.engine_session_reopens = counter(
            "engine_session_reopens", "turns resent in a reopened engine session after the engine lost the old one"
        )
        self.engine_session_fallbacks = counter(
            "engine_session_fallbacks", "turns sent without an engine session because none could be opened in time"
        )
        self.engine_sessions_at_cap = counter(
            "engine_sessions_at_cap", "turns sent without an engine session because their worker already held "
            "--max-engine-sessions-per-engine open (each holds one of the engine's request rows)"
        )
        self.engine_control_failures = counter(
            "engine_control_failures", "engine control calls (abort, open/close session, ready, ...) that failed, by "
            "path and kind: timeout (no answer within the call's deadline, the wait for a connection included) or "
            "transport (a refused or broken connection)", ("path", "kind"),
        )
        self.engine_sessions_unclosed = counter(
            "engine_sessions_unclosed", "engine sessions whose close never landed (its retries reached their horizon, "
            "or too many were being retried): the engine's idle timeout frees them; GET /admin/sessions lists the "
            "latest")
        self.engine_close_retries = counter(
            "engine_close_retries", "close_session calls retried in the background after a failure, by outcome: "
            "retry (one more attempt), closed (it landed), moot (the engine's own idle timeout closes it)",
            ("outcome",),
        )
        self.engine_abort_retries = counter(
            "engine_abort_retries", "abort_request calls retried in the background after the engine did not answer, "
            "by outcome: retry (one more attempt), aborted (it landed), moot (the request ended by itself or with its "
            "engine, or the retry gave up at its horizon), refused (the engine refused it for good)", ("outcome",),
        )
        self.limit_refusals = counter(
            "limit_refusals", "requests refused by a configured limit: sessions (--max-sessions, 503), session_tokens "
            "(--max-session-tokens, 400), context (a prompt that cannot fit the engine's context, 400)", ("limit",),
        )
        self.ignored_fields = counter(
            "ignored_fields", "request fields accepted without effect on the tokens (cache_control, metadata, "
            "hosted tools, ...), by API and field", ("api", "field"),
        )
        self.sessions_created = counter("sessions_created", "sessions created")
        self.fork_prefills = counter(
            "fork_prefills", "shared prefixes of forks (primed prompts, forked histories an engine session held) sent "
            "to the engine to prefill (turns/prefill.py), by result: done, refused (a 4xx/5xx answer), failed (no "
            "answer in time, or aborted)", ("result",),
        )
        self.sessions_deleted = counter("sessions_deleted", "sessions deleted by DELETE")
        self.sessions_expired = counter("sessions_expired", "sessions deleted by the idle sweep")
        self.sessions_moved = counter(
            "engine_sessions_moved", "sessions moved to another engine worker because theirs failed its health checks"
        )
        self.loop_lag = histogram(
            "event_loop_lag_seconds", "how late the event loop ran a ticker scheduled every interval", LAG_BUCKETS
        )
        self.loop_lag_last = Gauge(f"{PREFIX}_event_loop_lag_last_seconds", "the latest lag measurement", registry=r)

        self._stages = {s: self._histogram(self.stage_seconds.labels(s)) for s in STAGES}
        self._chat_seconds = self._histogram(self.chat_seconds)
        self._engine_seconds = self._histogram(self.engine_seconds)
        self._added_seconds = self._histogram(self.added_seconds)
        self._tokens = {k: self._tally(self.tokens.labels(k)) for k in TOKEN_KINDS}
        self._aborts = {c: self.aborts.labels(c.value) for c in AbortReason}
        self._refusals = {k: self.limit_refusals.labels(k) for k in LIMITS}
        self._continuations = {r: self.continuations.labels(r) for r in CONTINUATION_RESULTS}
        self._responses: dict[tuple[str, str, int], Tally] = {}
        # Every rollback reason is exported from the start (at 0), so a rate() has a series to start from.
        self._rollbacks: dict[str, Any] = {r: self.rollbacks.labels(r) for r in ROLLBACK_REASONS}
        self._validation: dict[str, Any] = {}
        self._ignored: dict[tuple[str, str], Any] = {}
        self._segments: dict[str, Any] = {r: self.segments_started.labels(r) for r in SEGMENT_REASONS if r != "first"}

    def _tally(self, child: Any) -> Tally:
        tally = Tally(child)
        self._tallies.append(tally)
        return tally

    def _histogram(self, child: Any) -> HistogramTally:
        tally = HistogramTally(child)
        self._tallies.append(tally)
        return tally

    # -- gauges of live state, read at scrape time ------------------------------------------------------
    def watch(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge whose value is `read()` at scrape time (never updated on the hot path)."""
        Gauge(f"{PREFIX}_{name}", doc, registry=self.registry).set_function(read)

    def watch_count(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A counter whose value is `read()` at scrape time: a count its owner keeps (a cache's hits)."""
        self.registry.register(_ReadCounter(f"{PREFIX}_{name}", doc, read))

    # -- counting helpers --------------------------------------------------------------------------------
    def response(self, route: str, method: str, status: int) -> None:
        key = (route, method, status)
        tally = self._responses.get(key)
        if tally is None:
            tally = self._responses[key] = self._tally(self.responses.labels(route, method, str(status)))
        tally.inc()

    def stage(self, name: str, seconds: float) -> None:
        self._stages[name].observe(seconds)

    def engine(self, seconds: float) -> None:
        """One engine /generate call's latency, response read included."""
        self._engine_seconds.observe(seconds)

    def chat_done(self, chat_seconds: float, engine_seconds: float) -> None:
        self._chat_seconds.observe(chat_seconds)
        self._added_seconds.observe(max(0.0, chat_seconds - engine_seconds))

    def turn_tokens(self, prompt: int, cached: int, completion: int) -> None:
        self._tokens["prompt"].inc(prompt)
        self._tokens["cached"].inc(cached)
        self._tokens["completion"].inc(completion)

    def rollback(self, reason: str) -> None:
        _child(self._rollbacks, reason, self.rollbacks, reason).inc()

    def segment_started(self, reason: str) -> None:
        _child(self._segments, reason, self.segments_started, reason).inc()

    def validation_failure(self, rule: str) -> None:
        _child(self._validation, rule, self.validation_failures, rule).inc()

    def ignored(self, api: str, fields: Sequence[str]) -> None:
        """Fields of one request that were accepted and ignored (the front ends' fixed lists: bounded labels)."""
        for field in fields:
            _child(self._ignored, (api, field), self.ignored_fields, api, field).inc()

    def refused(self, limit: str) -> None:
        self._refusals[limit].inc()

    def abort(self, cause: AbortReason) -> None:
        self._aborts[cause].inc()

    def continuation(self, result: str) -> None:
        self._continuations[result].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _child(children: dict[Any, Any], key: Any, metric: Any, *labels: str) -> Any:
    """The child of a labelled metric, created at first use and kept in `children`, so the hot path looks it up in
    a plain dict instead of calling `labels()` (a lock and a label check) on every count."""
    child = children.get(key)
    if child is None:
        child = children[key] = metric.labels(*labels)
    return child


# -- event-loop lag --------------------------------------------------------------------------------------------
class LoopLagTicker:
    """Every `interval` seconds, record how much later than asked the loop woke the ticker up."""

    def __init__(self, metrics: Metrics, interval: float = 0.1) -> None:
        self._metrics = metrics
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self._interval
        observe = self._metrics.loop_lag.observe
        last = self._metrics.loop_lag_last.set
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(interval)
            lag = max(0.0, time.perf_counter() - asked - interval)
            observe(lag)
            last(lag)
