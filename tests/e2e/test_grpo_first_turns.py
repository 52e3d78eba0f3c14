"""A GRPO group through a real session server: G sessions open with the same first request, the server renders it
once (trajectory/first_turns.py), and every one of them sends the engine exactly the ids a fresh render gives -- the
ones a server without the cache sends. /metrics counts the hits and misses; `--first-turn-cache-tokens 0` keeps none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import chat_url, new_session
from support.stack import Stack, StackFactory

GROUP = 4
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}]


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    servers = {"server": [], "uncached": ["--first-turn-cache-tokens", "0"]}
    with stack_factory(family="qwen3", servers=servers, proxied=set(servers)) as stack:
        yield stack


def counts(server: str) -> dict[str, float]:
    """The first-turn cache's samples on /metrics, by name less the common prefix (`hits_total`, ...)."""
    text = httpx.get(f"{server}/metrics", timeout=10).text
    prefix = "session_server_first_turn_cache_"
    return {s.name.removeprefix(prefix): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(prefix)}


def first_prompt(stack: Stack, server: str, body: dict[str, Any]) -> list[int]:
    """The input_ids the engine received for a new session's first turn of `body`."""
    assert stack.proxy is not None
    sid = new_session(server)
    reply = httpx.post(chat_url(server, sid), json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    (call,) = [c for c in stack.proxy.generates() if c["routing_key"] == sid]
    ids: list[int] = call["request"]["input_ids"]
    # The second turn continues the session's own stored ids (the shared array is never written).
    history = [*body["messages"], reply.json()["choices"][0]["message"],
               {"role": "user", "content": "more [[sim: tokens 3]]"}]
    assert httpx.post(chat_url(server, sid), json={**body, "messages": history}, timeout=30).status_code == 200
    stored = httpx.get(f"{server}/sessions/{sid}").json()["token_ids"]
    assert stored[: len(ids)] == ids
    return ids


def test_a_group_renders_its_first_request_once(stack: Stack) -> None:
    server = stack.server
    body = {"messages": [{"role": "system", "content": "You are a careful agent."},
                         {"role": "user", "content": "Solve task 17. [[sim: tokens 6]]"}], "tools": TOOLS}
    before = counts(server)
    prompts = [first_prompt(stack, server, body) for _ in range(GROUP)]
    after = counts(server)
    assert after["misses_total"] - before["misses_total"] == 1
    assert after["hits_total"] - before["hits_total"] == GROUP - 1
    assert after["tokens"] >= len(prompts[0])
    assert all(p == prompts[0] for p in prompts)
    assert first_prompt(stack, stack["uncached"], body) == prompts[0]  # what a fresh render sends

    other = {**body, "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "look it up"}}]}
    changed = first_prompt(stack, server, other)  # another prompt: a miss, its own ids
    assert counts(server)["misses_total"] == after["misses_total"] + 1
    assert changed != prompts[0] and changed == first_prompt(stack, stack["uncached"], other)


def test_a_zero_budget_keeps_no_first_turns(stack: Stack) -> None:
    server = stack["uncached"]
    body = {"messages": [{"role": "user", "content": "Solve task 5. [[sim: tokens 4]]"}]}
    before = counts(server)
    first_prompt(stack, server, body)
    first_prompt(stack, server, body)
    after = counts(server)
    assert after["hits_total"] == before["hits_total"] and after["tokens"] == 0
