"""Push a trainer's new weights into a running SGLang engine without losing a turn.

The order (docs/design.md 5.1, the session server's admin routes):

1. `POST /admin/pause {"mode": "in_place"}` on every session server in front of the engine: each pauses the engine
   in place (SGLang's `/pause_generation` mode `in_place`: running requests keep their KV and stay in the batch) and
   answers new chats 503 + Retry-After, which agents retry (rollout.episodes does);
2. SGLang's `POST /update_weights_from_disk` with the saved checkpoint, its `weight_version` (what every token
   sampled from now on is recorded with) and `abort_all_requests: false` (the default of 0.5.23, said explicitly: an
   update that aborts would cost each running turn a continuation); the radix cache is flushed only when asked,
   since SGLang refuses a flush (and fails the call) while requests hold KV;
3. `POST /admin/continue {"weight_version"}` on every server, always, even when the update failed (then without a
   version: each server asks the engine what it serves): an engine left paused stalls every episode. The version is
   what each server keys the engine's radix cache by from now on (`extra_key`), so no turn reuses a prefix the old
   weights computed.

With the server's default `--straddled-replies recompute`, the pause cuts the replies running on the engine and the
server continues each under the new weights, re-prefilling prompt + partial reply: every token is its version's own,
the old ones keep their version (the sample's `weight_version_spans`). With `keep`, they run on in place and their
later tokens are the new weights' on KV of the old. Saving is `save_pretrained` (safetensors) into a directory SGLang
reads; the engine must serve the same architecture.

LoRA adapters (issue 40, `push_adapter`): a new revision of an adapter is loaded under its own name (`NAME@REV`;
revision "0" is the bare `NAME` that `--lora-paths NAME=DIR` loads) with SGLang's `POST /load_lora_adapter`, in the
same order: pause every server, load, continue each with `{"adapter": {"name", "revision"}}`, which the server checks
in the engine's model list and pins new sessions to (sessions/engine/adapters.py). Loading under a new name touches
no running request (the old revision stays loaded for the sessions pinned to it), so `pause=False` skips the pause.
Before loading, the engine's room is checked: at `--max-loaded-loras` SGLang 0.5.23 does not refuse a load, it evicts
the least recently used adapter (measured), which a pinned session may still sample with; the push refuses instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


class WeightPushError(RuntimeError):
    """A step of the push was refused (the message names it and carries the body)."""


@dataclass(frozen=True)
class PushResult:
    version: str
    seconds: float          # pause to continue
    update_seconds: float   # the engine's load alone
    message: str


def save_weights(model: Any, directory: str | Path) -> Path:
    """`model.save_pretrained(directory)` as safetensors (a transformers model); returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


@dataclass(frozen=True)
class AdapterPushResult:
    name: str
    revision: str
    engine_name: str        # what the engine serves it as (`lora_path`)
    seconds: float          # pause to continue
    load_seconds: float     # the engine's load alone


def adapter_engine_name(name: str, revision: str) -> str:
    """The engine name of an adapter revision (session_server/engine/adapters.py AdapterRef.engine_name)."""
    return name if revision == "0" else f"{name}@{revision}"


class WeightPusher:
    """Pause every session server in place, load a checkpoint into the engine under a version, continue."""

    def __init__(self, engine_url: str, session_servers: Sequence[str], *, admin_token: str | None = None,
                 timeout: float = 300.0) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.servers = tuple(s.rstrip("/") for s in session_servers)
        headers = {"authorization": f"Bearer {admin_token}"} if admin_token else None
        self._http = httpx.AsyncClient(timeout=timeout, headers=headers)

    async def __aenter__(self) -> WeightPusher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = await self._http.post(url, json=body if body is not None else {})
        if r.status_code != 200:
            raise WeightPushError(f"POST {url}: {r.status_code} {r.text[:500]}")
        out = r.json() if r.content else {}
        return out if isinstance(out, dict) else {"body": out}

    async def push(self, checkpoint: str | Path, version: str, *, flush_cache: bool = False) -> PushResult:
        """Load `checkpoint` into the engine as `version` with every server paused in place; continue them all."""
        started = time.perf_counter()
        paused: list[str] = []
        loaded: str | None = None
        try:
            for server in self.servers:
                await self._post(f"{server}/admin/pause", {"mode": "in_place"})
                paused.append(server)
            load_started = time.perf_counter()
            out = await self._post(f"{self.engine_url}/update_weights_from_disk", {
                "model_path": str(checkpoint), "weight_version": version, "abort_all_requests": False,
                "flush_cache": flush_cache})
            update_seconds = time.perf_counter() - load_started
            if not out.get("success"):
                raise WeightPushError(f"update_weights_from_disk refused: {out}")
            loaded = version
        finally:
            # Every server paused is continued, whatever failed above.
            body = {"weight_version": loaded} if loaded is not None else {}
            results = await asyncio.gather(*(self._post(f"{s}/admin/continue", body) for s in paused),
                                           return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise WeightPushError(f"continue failed on {len(failed)} server(s): {failed[0]}")
        return PushResult(version, time.perf_counter() - started, update_seconds, str(out.get("message", "")))

    async def push_adapter(self, adapter_dir: str | Path, name: str, revision: str, *,
                           pause: bool = True) -> AdapterPushResult:
        """Load `adapter_dir` as revision `revision` of adapter `name` (under `NAME@REV`), every server paused in
        place around the load when `pause`; every server is told the revision at its continue."""
        engine_name = adapter_engine_name(name, revision)
        await self._check_adapter_room(engine_name)
        started = time.perf_counter()
        paused: list[str] = []
        loaded = False
        load_seconds = 0.0
        try:
            if pause:
                for server in self.servers:
                    await self._post(f"{server}/admin/pause", {"mode": "in_place"})
                    paused.append(server)
            load_started = time.perf_counter()
            out = await self._post(f"{self.engine_url}/load_lora_adapter",
                                   {"lora_name": engine_name, "lora_path": str(adapter_dir)})
            load_seconds = time.perf_counter() - load_started
            if not out.get("success"):
                raise WeightPushError(f"load_lora_adapter refused: {out}")
            loaded = True
        finally:
            body = {"adapter": {"name": name, "revision": revision}} if loaded else {}
            told = self.servers if loaded else paused  # a continue while running is harmless: it tells the revision
            results = await asyncio.gather(*(self._post(f"{s}/admin/continue", body) for s in told),
                                           return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise WeightPushError(f"continue failed on {len(failed)} server(s): {failed[0]}")
        return AdapterPushResult(name, revision, engine_name, time.perf_counter() - started, load_seconds)

    async def _check_adapter_room(self, engine_name: str) -> None:
        """WeightPushError when the engine holds `--max-loaded-loras` adapters already, or `engine_name` itself."""
        info = await self._http.get(f"{self.engine_url}/server_info")
        info.raise_for_status()
        limit = info.json().get("max_loaded_loras")
        models = await self._http.get(f"{self.engine_url}/v1/models")
        models.raise_for_status()
        held = [m["id"] for m in models.json().get("data", []) if m.get("parent")]
        if engine_name in held:
            raise WeightPushError(f"the engine already holds adapter {engine_name!r}: push a new revision")
        if isinstance(limit, int) and len(held) >= limit:
            raise WeightPushError(
                f"the engine holds {len(held)} adapters ({', '.join(held)}), its --max-loaded-loras {limit}: loading "
                f"{engine_name!r} would make SGLang evict the least recently used one, which a pinned session may "
                "still sample with. Wait until the session servers unload the revisions no session holds (they do "
                "once their sessions end), or start the engine with a larger --max-loaded-loras")

    async def engine_version(self) -> str:
        """The weight version the engine serves now (its `GET /model_info`)."""
        r = await self._http.get(f"{self.engine_url}/model_info")
        r.raise_for_status()
        return str(r.json()["weight_version"])
