"""A fork against SGLang itself: each child's first turn prefills only its new tokens, because the parent's history
is in the engine's radix cache (`cached_tokens` in SGLang's meta_info), and sends exactly the parent's stored ids as
its prompt's head (trajectory/forks.py, issue 39)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import chat_url, new_session
from support.sglang_engine import Served, ServeFactory

GREEDY = {"temperature": 0, "max_tokens": 8}
CHILDREN = 3


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense") as s:
        yield s


def chat(served: Served, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(chat_url(served.server, sid), json={"messages": messages, **GREEDY}, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_childs_first_turn_prefills_only_its_new_tokens(served: Served) -> None:
    parent = new_session(served.server)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant. " + " ".join(f"rule {i}." for i in range(80))},
        {"role": "user", "content": "Start the task."},
    ]
    reply = chat(served, parent, history)
    history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    fork = httpx.post(f"{served.server}/sessions/{parent}/fork", json={"n": CHILDREN}, timeout=30)
    assert fork.status_code == 200, fork.text
    children, position = fork.json()["session_ids"], fork.json()["fork_position"]
    stored = httpx.get(f"{served.server}/sessions/{parent}", timeout=30).json()["token_ids"]
    assert position == len(stored) > 200
    served.proxy.clear()
    for i, child in enumerate(children):
        chat(served, child, [*history, {"role": "user", "content": f"Branch {i}: go on."}])
    calls = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert len(calls) == CHILDREN
    for call in calls:
        prompt = call["request"]["input_ids"]
        assert prompt[:position - 1] == stored[:position - 1]  # the stored head (its stop token may be replaced)
        cached = call["response"]["meta_info"]["cached_tokens"]
        new = len(prompt) - position
        # Only the new tokens are prefilled: the prefix is the radix cache's (the parent's last generated token,
        # whose KV the engine never computed, and a replaced stop token at most are prefilled again).
        assert cached >= position - 2 and len(prompt) - cached <= new + 2, (cached, position, len(prompt))
    for sid in (parent, *children):
        assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204


def test_a_primed_groups_first_turns_prefill_only_their_last_token(served: Served) -> None:
    """The prime has SGLang prefill the prompt (`max_new_tokens: 0`, a prefill-only request whose KV the radix cache
    keeps) before it answers, so the group's first turns, sent all at once, each find the whole prompt cached but the
    last token, which SGLang always computes (turns/prefill.py)."""
    prompt = [{"role": "system", "content": "You are a careful assistant. " + " ".join(f"law {i}." for i in range(90))},
              {"role": "user", "content": "Begin the primed task."}]
    parent = new_session(served.server)
    served.proxy.clear()
    primed = httpx.post(f"{served.server}/sessions/{parent}/prime", json={"messages": prompt}, timeout=300)
    assert primed.status_code == 200, primed.text
    n = primed.json()["prompt_tokens"]
    assert n > 200 and primed.json()["prefill"]["prompt_tokens"] == n, primed.json()
    (prime_call,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert prime_call["request"]["sampling_params"]["max_new_tokens"] == 0
    fork = httpx.post(f"{served.server}/sessions/{parent}/fork", json={"n": CHILDREN}, timeout=30)
    assert fork.status_code == 200, fork.text
    children = fork.json()["session_ids"]
    served.proxy.clear()

    async def first_turns() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(client.post(chat_url(served.server, sid), json={
                "messages": prompt, **GREEDY}) for sid in children)))

    assert all(r.status_code == 200 for r in asyncio.run(first_turns()))
    calls = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert len(calls) == CHILDREN
    for call in calls:
        assert call["request"]["input_ids"] == prime_call["request"]["input_ids"]
        assert call["response"]["meta_info"]["cached_tokens"] >= n - 1, call["response"]["meta_info"]
    for sid in (parent, *children):
        assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204
