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

    async def engine_version(self) -> str:
        """The weight version the engine serves now (its `GET /model_info`)."""
        r = await self._http.get(f"{self.engine_url}/model_info")
        r.raise_for_status()
        return str(r.json()["weight_version"])
