"""A GRPO group through a real session server: G sessions open with the same first request, the server renders it
once (trajectory/first_turns.py), and every one of them sends the engine exactly the ids a fresh render gives -- the
ones a server without the cache sends. /metrics counts the hits and misses; `--first-turn-cache-tokens 0` keeps none.
"""

from __future__ import annotations

import json
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
    servers = {"server": [], "uncached": ["--first-turn-cache-tokens", "0"], "small": ["--inline-below-bytes", "128"]}
    with stack_factory(family="qwen3", servers=servers, proxied=set(servers)) as stack:
        yield stack


def counts(server: str) -> dict[str, float]:
    """The first-turn samples on /metrics, by name less the common prefix (`cache_hits_total`, `on_loop_total`)."""
    text = httpx.get(f"{server}/metrics", timeout=10).text
    prefixes = ("session_server_first_turn_", "session_server_first_turns_")
    return {s.name.removeprefix(p): s.value for f in text_string_to_metric_families(text) for s in f.samples
            for p in prefixes if s.name.startswith(p)}


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
    assert after["cache_misses_total"] - before["cache_misses_total"] == 1
    assert after["cache_hits_total"] - before["cache_hits_total"] == GROUP - 1
    # The repeats came one after another with the same body: each prepared on the event loop (repeated_first_turns.py)
    assert after["on_loop_total"] - before["on_loop_total"] == GROUP - 1
    assert after["cache_tokens"] >= len(prompts[0])
    assert all(p == prompts[0] for p in prompts)
    assert first_prompt(stack, stack["uncached"], body) == prompts[0]  # what a fresh render sends

    other = {**body, "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "look it up"}}]}
    changed = first_prompt(stack, server, other)  # another prompt: a miss, its own ids
    assert counts(server)["cache_misses_total"] == after["cache_misses_total"] + 1
    assert changed != prompts[0] and changed == first_prompt(stack, stack["uncached"], other)

    # Another body with the same render (a different max_tokens): not predicted, so the pool's, and still a hit.
    before = counts(server)
    assert first_prompt(stack, server, {**body, "max_tokens": 64}) == prompts[0]
    after = counts(server)
    assert after["cache_hits_total"] - before["cache_hits_total"] == 1
    assert after["on_loop_total"] == before["on_loop_total"]


def test_a_zero_budget_keeps_no_first_turns(stack: Stack) -> None:
    server = stack["uncached"]
    body = {"messages": [{"role": "user", "content": "Solve task 5. [[sim: tokens 4]]"}]}
    before = counts(server)
    first_prompt(stack, server, body)
    first_prompt(stack, server, body)
    after = counts(server)
    assert after["cache_hits_total"] == before["cache_hits_total"] and after["cache_tokens"] == 0
    assert after["on_loop_total"] == 0  # nothing kept: no first turn is tried on the loop


def test_a_repeat_larger_than_the_loop_takes_goes_to_the_pool(stack: Stack) -> None:
    """Only bodies below --inline-below-bytes are parsed on the loop: a larger repeat is still a hit, on the pool."""
    server = stack["small"]
    body = {"messages": [{"role": "user", "content": "Solve task 9. [[sim: tokens 4]]"}], "tools": TOOLS}
    assert len(json.dumps(body)) > 128
    before = counts(server)
    assert first_prompt(stack, server, body) == first_prompt(stack, server, body)
    after = counts(server)
    assert after["cache_hits_total"] - before["cache_hits_total"] == 1
    assert after["on_loop_total"] == before["on_loop_total"]
