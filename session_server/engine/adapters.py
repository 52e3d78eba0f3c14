"""LoRA adapters per session (issue 40): which adapter revision samples each session, and what the engines hold.

Why: the recurring failure of LoRA RL is silent -- rollouts that ran on the base model or on a stale adapter while the
trainer believed otherwise. So a session is pinned to one adapter revision (`AdapterRef`) at its first turn and every
engine request of it names that revision (`lora_path`); a turn for an adapter the engines do not hold is refused
before any engine call, never answered by the base model; and each turn records the revision that sampled it.

Names: revision "0" of adapter `a1` is the engine's `a1` (as `--lora-paths a1=DIR` loads it); a later revision `N`
is loaded under the name `a1@N` (`POST /load_lora_adapter`, rollout/weight_push.py `push_adapter`), so the revisions
live side by side: a session pinned to `a1` finishes under it while new sessions (or, with `--adapter-revisions
latest`, every next turn) take `a1@N`. SGLang appends the adapter's id to each request's radix-cache key, and the
server keys the cache by adapter revision as well (`adapter_cache_key`, beside the weight version's key), so no prefix
is shared across adapters or revisions.

What the engines hold is read off their `/v1/models` (SGLang 0.5.23 lists each loaded adapter as a model whose
`parent` is the base): at startup, after every load the trainer announces (`learn`), and once on a turn for a revision
not known to be loaded. A revision superseded by a newer one is unloaded (`/unload_lora_adapter` on every worker) once
no session holds it, and never named again: 0.5.23 silently re-loads an unloaded adapter from its path when a request
names it, so the refusal has to be ours. A server knows only its own sessions: with several servers in front of one
engine, run them with --keep-adapter-revisions (nothing is unloaded; the trainer unloads what it knows is unused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from session_server.engine.placement import EnginePlacement
from session_server.errors import EngineUnavailableError
from trajectory.errors import RequestValidationError, SessionError

logger = logging.getLogger("session_server.engine.adapters")

INITIAL_REVISION = "0"  # the revision of an adapter loaded under its bare name
REVISION_MARK = "@"
STARTUP_TIMEOUT = 10.0  # seconds the startup check waits for the engines' model lists
METADATA_KEY = "lora_adapter"  # POST /sessions metadata: the session's adapter ("" for the base model)


class AdapterUnavailableError(SessionError):
    """A turn names an adapter revision the engines do not hold (or one this server unloaded): refused before any
    engine call, so it is never answered by the base model."""

    status = 404
    code = "adapter_not_found"


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One revision of one adapter, as sessions are pinned to it."""

    name: str
    revision: str

    @property
    def engine_name(self) -> str:
        """The name the engine serves it under (`lora_path` of a request)."""
        return self.name if self.revision == INITIAL_REVISION else f"{self.name}{REVISION_MARK}{self.revision}"

    @classmethod
    def parse(cls, engine_name: str) -> AdapterRef:
        name, mark, revision = engine_name.rpartition(REVISION_MARK)
        return cls(name, revision) if mark and name and revision else cls(engine_name, INITIAL_REVISION)


def adapter_cache_key(weights_key: str, adapter: AdapterRef | None) -> str:
    """The `extra_key` of a request for the weights keyed `weights_key` (engine/versions.py) and `adapter` (None: the
    base model, the key of issue 38 unchanged)."""
    return weights_key if adapter is None else f"{weights_key}|lora:{adapter.engine_name}"


def model_adapter(model: str | None) -> str | None:
    """The adapter an OpenAI `model` field names as SGLang spells it, `base:adapter`; None when it names none."""
    if not model or ":" not in model:
        return None
    adapter = model.rpartition(":")[2]
    return adapter or None


def _revision_order(revision: str) -> tuple[int, int, str]:
    return (1, int(revision), "") if revision.isdigit() else (0, 0, revision)


def listed_adapters(body: bytes) -> set[str] | None:
    """The adapter names in an OpenAI model list (entries with a `parent`: SGLang's way to list a LoRA adapter);
    None for a body that is not such a list."""
    try:
        listing = msgspec.json.decode(body)
        data = listing["data"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return None
    if not isinstance(data, list):
        return None
    return {str(m["id"]) for m in data if isinstance(m, dict) and m.get("parent") and m.get("id")}


class AdapterBook:
    """The server's adapters: what the engines hold, each adapter's newest revision, the pin of every session."""

    def __init__(self, engine: EnginePlacement, *, follow: str = "pinned", default: str | None = None,
                 unload: bool = True) -> None:
        self.engine = engine
        self.unload = unload  # unload superseded revisions once unheld (--keep-adapter-revisions: never)
        self.follow = follow  # "pinned": a session keeps its revision; "latest": each turn takes the newest
        self.default = default or None  # --lora-adapter: the adapter of sessions that name none
        self.loaded: set[str] | None = None  # engine names every worker lists (None: not asked yet)
        self.current: dict[str, str] = {}  # adapter name -> the revision new pins take (learned, else the newest)
        self.superseded: set[str] = set()  # engine names a newer revision replaced: unloaded once unheld
        self.unloaded: set[str] = set()  # engine names this server unloaded: never named again
        self.pins: dict[str, AdapterRef | None] = {}  # session id -> its revision (None: pinned to the base model)
        self.holders: dict[str, set[str]] = {}  # engine name -> the sessions pinned to it
        self._unloading: set[asyncio.Task[Any]] = set()

    # -- what the engines hold ------------------------------------------------------------------------------
    async def refresh(self) -> set[str]:
        """Ask every worker's `/v1/models`; what all of them list is held (a worker that does not answer, or answers
        with something else than a model list, makes it an EngineUnavailableError)."""
        lists = []
        for worker in self.engine.workers:
            reply = await worker.client.models()
            listed = listed_adapters(reply.body) if reply.ok else None
            if listed is None:
                raise EngineUnavailableError(f"engine {worker.url} gave no model list ({reply.status}): cannot tell "
                                             "which LoRA adapters it holds")
            lists.append(listed)
        held = set.intersection(*lists) - self.unloaded
        self.loaded = held
        newest: dict[str, str] = {}
        for engine_name in held:
            ref = AdapterRef.parse(engine_name)
            newest[ref.name] = max(newest.get(ref.name, ref.revision), ref.revision, key=_revision_order)
        for name, revision in newest.items():
            self.current.setdefault(name, revision)  # a revision a trainer announced stays the one new pins take
        return held

    async def startup(self) -> None:
        """The check before serving, with --lora-adapter: the engines' adapters, and the default among them
        (RuntimeError: the server refuses to start). An engine that does not answer in time is asked again on the
        first adapter turn; without a default adapter nothing is asked until a session names one (a server of the
        base model alone costs its engines no request)."""
        if self.default is None:
            return
        try:
            async with asyncio.timeout(STARTUP_TIMEOUT):
                held = await self.refresh()
        except (EngineUnavailableError, TimeoutError) as exc:
            logger.info("LoRA adapters not checked at startup (%s); checked on the first adapter turn", exc)
            return
        if held:
            logger.info("engine LoRA adapters: %s", ", ".join(sorted(held)))
        if self.default is not None and self.default not in self.current:
            raise RuntimeError(f"--lora-adapter {self.default!r}: the engine holds no such adapter (it lists "
                               f"{sorted(held) or 'none'}; start it with --enable-lora --lora-paths "
                               f"{self.default}=<dir>)")

    async def learn(self, name: str, revision: str) -> AdapterRef:
        """A trainer loaded `revision` of `name` (POST /admin/continue `{"adapter": ...}`): checked against the engines'
        list (EngineUnavailableError when they do not hold it), then the revision new pins take; the one it replaces
        is unloaded once no session holds it."""
        ref = AdapterRef(name, revision)
        held = await self.refresh()
        if ref.engine_name not in held:
            raise EngineUnavailableError(f"adapter {name!r} revision {revision!r}: the engines do not list "
                                         f"{ref.engine_name!r} (they hold {sorted(held) or 'none'}); load it first "
                                         "(POST /load_lora_adapter)")
        old = self.current.get(name)
        self.current[name] = revision
        if old is not None and old != revision:
            self.superseded.add(AdapterRef(name, old).engine_name)
        self.superseded.discard(ref.engine_name)
        await self.unload_unheld()
        return ref

    # -- pins -------------------------------------------------------------------------------------------------
    def wanted(self, metadata: dict[str, Any], model: str | None) -> str | None:
        """The adapter a session asks for: its metadata's `lora_adapter` ("" the base model), else the request's
        `model` field `base:adapter`, else --lora-adapter."""
        if METADATA_KEY in metadata:
            named = metadata[METADATA_KEY]
            if named is not None and not isinstance(named, str):
                raise RequestValidationError(f"session metadata {METADATA_KEY!r} must be a string")
            return named or None
        return model_adapter(model) or self.default

    async def for_turn(self, session_id: str, metadata: dict[str, Any], model: str | None,
                       recorded: AdapterRef | None = None) -> AdapterRef | None:
        """The adapter revision of a session's next turn, pinned at its first (`recorded`: the one its last stored
        turn ran with, for a session restored from a journal), checked to be held before any engine call."""
        if session_id in self.pins:
            ref = self.pins[session_id]
            named = model_adapter(model)
            if named is not None and named != (ref.name if ref is not None else None):
                raise RequestValidationError(
                    f"model {model!r} names adapter {named!r}, but the session is pinned to "
                    f"{'the base model' if ref is None else repr(ref.name)}: start a new session for another adapter")
            if ref is not None and self.follow == "latest":
                newest = self.current.get(ref.name, ref.revision)
                if newest != ref.revision:
                    ref = self._pin(session_id, AdapterRef(ref.name, newest))
        else:
            name = recorded.name if recorded is not None else self.wanted(metadata, model)
            if name is not None and recorded is None and name == model_adapter(model) and METADATA_KEY not in metadata:
                name = await self._model_field_adapter(name)
            if name is None:
                self.pins[session_id] = None
                return None
            if recorded is not None and self.follow == "pinned":
                ref = recorded
            else:
                if name not in self.current:
                    await self._refresh_quietly()
                if name not in self.current:
                    raise AdapterUnavailableError(f"the engines hold no LoRA adapter {name!r} (they hold "
                                                  f"{sorted(self.loaded or ()) or 'none'})")
                ref = AdapterRef(name, self.current[name])
            ref = self._pin(session_id, ref)
        if ref is not None:
            await self.check(ref)
        return ref

    async def _model_field_adapter(self, name: str) -> str | None:
        """An adapter a `model` field names: None when the engines serve no adapter at all (no --enable-lora), where
        a colon is part of a model's name (`qwen3:8b`), not SGLang's `base:adapter`."""
        if self.loaded is None:
            await self._refresh_quietly()
        return None if self.loaded is not None and not self.loaded and name not in self.current else name

    def _pin(self, session_id: str, ref: AdapterRef) -> AdapterRef:
        old = self.pins.get(session_id)
        if old is not None and old != ref:
            self._drop_holder(session_id, old)
        self.pins[session_id] = ref
        self.holders.setdefault(ref.engine_name, set()).add(session_id)
        if old is not None and old != ref:
            self._unload_soon()
        return ref

    async def check(self, ref: AdapterRef) -> None:
        """AdapterUnavailableError unless the engines hold `ref` (asked again once when it is not known to be)."""
        name = ref.engine_name
        if name in self.unloaded:
            raise AdapterUnavailableError(f"adapter {ref.name!r} revision {ref.revision!r} ({name!r}) was unloaded: "
                                          "it samples no more turns; start a new session")
        if self.loaded is None or name not in self.loaded:
            await self._refresh_quietly()
        if self.loaded is None or name not in self.loaded:
            raise AdapterUnavailableError(f"the engines do not hold adapter {ref.name!r} revision {ref.revision!r} "
                                          f"({name!r}; they hold {sorted(self.loaded or ()) or 'none'})")

    async def _refresh_quietly(self) -> None:
        with contextlib.suppress(EngineUnavailableError):
            await self.refresh()

    def release(self, session_id: str) -> None:
        """The session is gone: its revision may be unloaded now (in the background)."""
        ref = self.pins.pop(session_id, None)
        if ref is not None:
            self._drop_holder(session_id, ref)
            self._unload_soon()

    def _drop_holder(self, session_id: str, ref: AdapterRef) -> None:
        holders = self.holders.get(ref.engine_name)
        if holders is not None:
            holders.discard(session_id)
            if not holders:
                del self.holders[ref.engine_name]

    # -- unloading ---------------------------------------------------------------------------------------------
    def unheld(self) -> list[str]:
        """Superseded revisions no session holds: what `unload_unheld` unloads."""
        if not self.unload:
            return []
        return sorted(n for n in self.superseded if n not in self.holders and n not in self.unloaded)

    def _unload_soon(self) -> None:
        if not self.unheld():
            return
        task = asyncio.ensure_future(self.unload_unheld())
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)

    async def unload_unheld(self) -> list[str]:
        """Unload every superseded revision no session holds, on every worker; returns their engine names. Each is
        never named again, even where an engine refused the unload (it is logged)."""
        names = self.unheld()
        for name in names:
            self.unloaded.add(name)  # first: no turn names it from now on, whatever the engines answer
            if self.loaded is not None:
                self.loaded.discard(name)
        await asyncio.gather(*(self._unload(name) for name in names))
        return names

    async def _unload(self, name: str) -> None:
        results = await asyncio.gather(*(w.client.generation_control("/unload_lora_adapter", {"lora_name": name})
                                         for w in self.engine.workers), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning("unloading adapter %s: %s (it is never named again)", name, failed[0])
        else:
            logger.info("adapter %s unloaded: no session holds it", name)

    async def aclose(self) -> None:
        for task in list(self._unloading):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def describe(self) -> dict[str, Any]:
        """For /admin/status: what is held, pinned and unloaded."""
        return {"loaded": sorted(self.loaded or ()), "current": dict(self.current),
                "pinned": {name: len(s) for name, s in self.holders.items()}, "unloaded": sorted(self.unloaded)}


def recorded_adapter(records: Iterable[Any]) -> AdapterRef | None:
    """The adapter revision of a stored session's last turn (records with `adapter`, `adapter_revision`)."""
    last = None
    for record in records:
        last = record
    if last is None or last.adapter is None:
        return None
    return AdapterRef(last.adapter, last.adapter_revision or INITIAL_REVISION)
