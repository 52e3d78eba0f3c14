"""`SessionClient`: the trainer's async handle on one or more session servers.

Each session lives on exactly one server and its OpenAI base URL (`{server}/sessions/{id}/v1`) pins it there, so
N independent servers scale out with no router in between: the client places each new session on the server with
the fewest sessions it currently holds there (ties broken round-robin) and remembers the id -> server mapping for
every later call (`base_url`, `collect`, `delete`).

`session()` is the safe way to hold a session: the DELETE runs on every exit, including errors and cancellation,
and is shielded so that cancelling the episode cannot cancel its own cleanup (a leaked session keeps its trajectory
and engine KV on the server until an operator sweeps it).
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import httpx

from rollout.errors import ServerConnectionError, SessionServerError, UnknownSessionError, error_for_status
from trajectory import Sample, samples_from_json, samples_from_safetensors
from trajectory.image_pixels import IMAGE_FORMS, ImageForm, with_pixel_values

logger = logging.getLogger(__name__)

SampleFormat = Literal["safetensors", "json"]
Placement = Literal["least_loaded", "round_robin"]


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class SessionClient:
    """Create, use, collect and delete sessions on one or several session servers.

    ```python
    async with SessionClient(["http://127.0.0.1:8000", "http://127.0.0.1:8001"]) as client:
        async with client.session(metadata={"task": 7}) as sid:
            agent = openai.AsyncOpenAI(base_url=client.base_url(sid), api_key="EMPTY")
            ...  # any OpenAI-compatible agent
            samples = await client.collect(sid, max_seq_len=8192)
    ```
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        *,
        timeout: float = 120.0,
        placement: Placement = "least_loaded",
        headers: dict[str, str] | None = None,
        max_connections: int = 256,
    ) -> None:
        urls = [servers] if isinstance(servers, str) else list(servers)
        if not urls:
            raise ValueError("at least one session server URL is required")
        if placement not in ("least_loaded", "round_robin"):
            raise ValueError(f"unknown placement {placement!r}")
        self.servers: tuple[str, ...] = tuple(url.rstrip("/") for url in urls)
        if len(set(self.servers)) != len(self.servers):
            raise ValueError("duplicate session server URL")
        self.placement = placement
        self._http = httpx.AsyncClient(
            timeout=timeout,
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._server_of: dict[str, str] = {}
        self._open: dict[str, int] = dict.fromkeys(self.servers, 0)
        self._cursor = itertools.count()

    async def __aenter__(self) -> SessionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections (sessions still open stay on their servers)."""
        await self._http.aclose()

    # -- placement -------------------------------------------------------------------------------------------

    def server_of(self, session_id: str) -> str:
        """The server holding `session_id`."""
        try:
            return self._server_of[session_id]
        except KeyError:
            raise UnknownSessionError(session_id) from None

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of the session: give it to any OpenAI-compatible agent."""
        return f"{self.server_of(session_id)}/sessions/{session_id}/v1"

    def open_sessions(self) -> dict[str, int]:
        """Sessions this client holds per server (what placement balances)."""
        return dict(self._open)

    def _placement_order(self) -> list[str]:
        """Servers in the order to try for a new session; rotation breaks ties so equal servers alternate."""
        start = next(self._cursor) % len(self.servers)
        rotated = list(self.servers[start:] + self.servers[:start])
        if self.placement == "round_robin":
            return rotated
        return sorted(rotated, key=lambda url: self._open[url])  # stable: ties keep the rotation

    # -- HTTP ------------------------------------------------------------------------------------------------

    async def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise ServerConnectionError(method, url, exc) from exc
        if response.status_code >= 400:
            raise error_for_status(
                method,
                url,
                response.status_code,
                _body_of(response),
                parse_retry_after(response.headers.get("retry-after")),
            )
        return response

    # -- API -------------------------------------------------------------------------------------------------

    async def create(self, metadata: dict[str, Any] | None = None) -> str:
        """Open a session on the least-loaded server and return its id.

        A server that refuses the connection is skipped (the request never reached it, so no session was
        created there); any other failure is raised.
        """
        payload = {"metadata": metadata} if metadata is not None else {}
        server, response = await self._open_sessions(payload)
        session_id: str = response.json()["session_id"]
        self._server_of[session_id] = server
        self._open[server] += 1
        return session_id

    async def _open_sessions(self, payload: dict[str, Any]) -> tuple[str, httpx.Response]:
        """POST /sessions on the least-loaded server that takes the connection (a refused connection created nothing
        there: the next server is tried); any other failure is raised."""
        last_error: ServerConnectionError | None = None
        for server in self._placement_order():
            try:
                return server, await self._request("POST", f"{server}/sessions", json=payload)
            except ServerConnectionError as exc:
                if not isinstance(exc.cause, httpx.ConnectError):
                    raise
                last_error = exc
                logger.warning("session server %s unreachable, trying the next one: %s", server, exc.cause)
        assert last_error is not None
        raise last_error

    async def fork(self, session_id: str, n: int, metadata: dict[str, Any] | None = None,
                   at: int | None = None) -> list[str]:
        """POST /sessions/{id}/fork: `n` new sessions that each start with the session's history (its current
        segment up to `at` turns, by default all of them); the children live on the parent's server (their ids
        route there)."""
        body: dict[str, Any] = {"n": n, "metadata": metadata or {}}
        if at is not None:
            body["at"] = at
        server = self.server_of(session_id)
        response = await self._request("POST", f"{server}/sessions/{session_id}/fork", json=body)
        ids: list[str] = response.json()["session_ids"]
        for child in ids:
            self._server_of[child] = server
        self._open[server] += len(ids)
        return ids

    async def prime(self, session_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> int:
        """POST /sessions/{id}/prime: render and tokenize the session's first prompt now (before its first turn), so
        that a fork at the prompt hands it to every child; returns its length in tokens."""
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        response = await self._request("POST", f"{self.server_of(session_id)}/sessions/{session_id}/prime", json=body)
        tokens: int = response.json()["prompt_tokens"]
        return tokens

    async def group(self, n: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    metadata: dict[str, Any] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[str]:
        """A GRPO group of `n` sessions that share their prompt, in one request (POST /sessions with `prime` and `n`):
        the server renders and tokenizes the prompt once, has the engine prefill it, and answers `n` sessions forked
        at it. Each child's first turn must send exactly `messages` and `tools` to skip the render."""
        prime: dict[str, Any] = {"messages": messages}
        if tools:
            prime["tools"] = tools
        if template_kwargs:
            prime["chat_template_kwargs"] = template_kwargs
        payload: dict[str, Any] = {"prime": prime, "n": n}
        if metadata is not None:
            payload["metadata"] = metadata
        server, response = await self._open_sessions(payload)
        ids: list[str] = response.json()["session_ids"]
        for child in ids:
            self._server_of[child] = server
        self._open[server] += len(ids)
        return ids

    async def info(self, session_id: str) -> dict[str, Any]:
        """`GET /sessions/{id}`: records, metadata, token ids and the mismatch report."""
        response = await self._request("GET", f"{self.server_of(session_id)}/sessions/{session_id}")
        return response.json()

    async def collect(
        self, session_id: str, max_seq_len: int | None = None, format: SampleFormat = "safetensors",
        images: ImageForm = "bytes", pixel_values: bool = True,
    ) -> list[Sample]:
        """The session's training samples, decoded (and dtype-checked) with trajectory's codecs.

        `images="bytes"` (the default) has the server send an image sample's files as the agent sent them (a few
        kilobytes a screenshot) and, with `pixel_values`, computes the pixel values here with the same processor
        (trajectory/image_pixels.py: identical to the server's), on a worker thread; `images="pixels"` has the
        server compute and send them (about 1.9 MB a 320x240 screenshot). Text-only samples are the same either way.
        """
        if format not in ("safetensors", "json"):
            raise ValueError(f"unknown sample format {format!r}")
        if images not in IMAGE_FORMS:
            raise ValueError(f"unknown image form {images!r}: one of {list(IMAGE_FORMS)}")
        payload: dict[str, Any] = {"max_seq_len": max_seq_len} if max_seq_len is not None else {}
        if images != "pixels":  # the server's default: a server from before the bytes form is asked nothing new
            payload["images"] = images
        accept = "application/octet-stream" if format == "safetensors" else "application/json"
        url = f"{self.server_of(session_id)}/sessions/{session_id}/samples"
        response = await self._request("POST", url, json=payload, headers={"accept": accept})
        samples = samples_from_safetensors(response.content) if format == "safetensors" \
            else samples_from_json(response.json())
        if pixel_values and any(s.image_bytes is not None for s in samples):
            samples = await asyncio.to_thread(lambda: [with_pixel_values(s) for s in samples])
        return samples

    async def delete(self, session_id: str) -> bool:
        """Delete the session; True if this call deleted it, False if the server had already forgotten it."""
        server = self.server_of(session_id)
        try:
            await self._request("DELETE", f"{server}/sessions/{session_id}")
            deleted = True
        except SessionServerError as exc:
            if exc.status != 404:
                raise
            deleted = False
        if self._server_of.pop(session_id, None) is not None:
            self._open[server] -= 1
        return deleted

    async def health(self) -> dict[str, dict[str, Any]]:
        """`GET /health` of every server, concurrently; raises on the first server that is not healthy."""
        responses = await asyncio.gather(*(self._request("GET", f"{url}/health") for url in self.servers))
        return {url: response.json() for url, response in zip(self.servers, responses, strict=True)}

    @asynccontextmanager
    async def held(self, session_id: str) -> AsyncIterator[str]:
        """`session()` for a session that already exists here (a fork's child): yield it, always delete it after."""
        try:
            yield session_id
        except BaseException:
            try:
                await _uncancellable(self.delete(session_id))
            except Exception:
                logger.exception("could not delete session %s after a failure", session_id)
            raise
        await _uncancellable(self.delete(session_id))

    @asynccontextmanager
    async def session(self, metadata: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """Yield a new session id and always delete the session afterwards, even on errors and cancellation.

        A failed DELETE is raised only when the body succeeded; otherwise it is logged and the body's exception
        propagates unchanged.
        """
        session_id = await self.create(metadata)
        async with self.held(session_id):
            yield session_id


async def _uncancellable(coro: Any) -> Any:
    """Run `coro` to completion even if the caller is cancelled meanwhile, then re-raise that cancellation."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                cancelled = True  # we were cancelled, the task goes on
        except Exception:
            pass  # the task's own failure, read from the task below
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            logger.error("cleanup failed during cancellation: %r", task.exception())
        raise asyncio.CancelledError
    return task.result()


def _body_of(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text
