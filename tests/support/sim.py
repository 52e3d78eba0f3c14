"""Helpers shared by the sglang-sim tests: prompt building, books checks and the baseline assertion."""

from __future__ import annotations

import time
from typing import Any

import httpx


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Render a conversation with the family's chat template and tokenize it, as the session server does."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def books(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/sim/books")
    assert r.status_code == 200
    data = r.json()
    assert data["ok"], data["errors"]
    return data


def wait_for(predicate: Any, timeout: float = 60.0, interval: float = 0.01) -> None:
    """Poll until `predicate()` holds. `timeout` only turns a hang into a failure: generous, since it costs nothing
    when the event comes and a loaded machine may take seconds to get there (issue 30)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def info(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/server_info")
    assert r.status_code == 200
    return r.json()


def assert_baseline(client: httpx.Client) -> None:
    """Nothing leaked: no requests, no sessions, books sound, and a flush returns every slot to the pool."""
    wait_for(lambda: info(client)["running_requests"] == 0 and info(client)["waiting_requests"] == 0)
    state = info(client)
    assert state["open_sessions"] == 0, state
    data = books(client)
    assert data["private"] == 0 and data["kv_locked_tokens"] == 0, data
    assert data["kv_used_tokens"] == data["kv_cached_tokens"], data
    assert client.post("/flush_cache").status_code == 200
    assert info(client)["kv_used_tokens"] == 0
