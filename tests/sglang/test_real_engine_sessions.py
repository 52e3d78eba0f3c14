"""`--engine-sessions` against SGLang's streaming sessions, and an engine SIGKILLed mid-turn then restarted.

With engine sessions each trajectory keeps its KV in an SGLang streaming session (`/open_session` with
`streaming: true` and a timeout, `session_params: {"id"}` on every turn from the second): the next turn's
`cached_tokens` covers the whole previous turn. The first turn opens none (it has nothing to reuse); the second
opens one and sends its whole prompt, which SGLang matches against the radix tree the first turn's KV went to. A
rollback (an append-only session cannot express it) closes that session and opens a fresh one. An engine killed with
SIGKILL mid-turn fails that turn (nothing committed); once the engine is back on its port the same turn succeeds in a
new engine session, the old one having died with the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import chat_url, new_session
from support.sglang_engine import Engines, Served, ServeFactory, assert_engine_clean, paced, wait_loads

TURN = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense", "--engine-sessions") as s:
        yield s


def chat(server: str, sid: str, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    return httpx.post(chat_url(server, sid), json={"messages": messages, **TURN, **fields}, timeout=300)


def test_turns_reuse_the_engine_session_and_a_rollback_reopens_it(served: Served) -> None:
    sid = new_session(served.server)
    served.proxy.clear()
    history: list[dict[str, Any]] = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Turn {turn}: tell me more."})
        r = chat(served.server, sid, history)
        assert r.status_code == 200, r.text
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    calls = served.proxy.settled()
    opened = [c for c in calls if c["path"] == "/open_session"]
    assert len(opened) == 1 and opened[0]["request"]["streaming"] is True and opened[0]["request"]["timeout"] > 0
    engine_sid = opened[0]["response"]
    generates = [c for c in calls if c["path"] == "/generate"]
    assert [(g["request"].get("session_params") or {}).get("id") for g in generates] == [None, engine_sid, engine_sid]
    assert len(generates[1]["request"]["input_ids"]) > len(generates[2]["request"]["input_ids"])  # whole, then new
    for prev, now in itertools.pairwise(generates):
        held = len(prev["request"]["input_ids"]) + prev["response"]["meta_info"]["completion_tokens"]
        # The radix tree (for the turn that opened the session) and then SGLang's session slot hold the whole
        # previous turn (its last sampled token has no KV yet).
        assert now["response"]["meta_info"]["cached_tokens"] >= held - 1, (held, now["response"]["meta_info"])

    # The same last request again: it diverges from what was stored (the stored turn ends with the reply), so the
    # server rolls back one turn, which an append-only engine session cannot express: a fresh one is opened.
    served.proxy.clear()
    r = chat(served.server, sid, history[:-1])
    assert r.status_code == 200, r.text
    paths = [c["path"] for c in served.proxy.settled() if c["path"] != "/v1/loads"]
    assert paths.index("/close_session") < paths.index("/open_session") < paths.index("/generate"), paths
    calls = served.proxy.settled()
    (closed,) = [c for c in calls if c["path"] == "/close_session"]
    assert closed["request"]["session_id"] == engine_sid
    (reopened,) = [c for c in calls if c["path"] == "/open_session"]
    (generate,) = [c for c in calls if c["path"] == "/generate"]
    assert generate["request"]["session_params"]["id"] == reopened["response"] != engine_sid
    info = httpx.get(f"{served.server}/sessions/{sid}", timeout=10).json()
    assert info["rollbacks"] == 1
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204
    assert_engine_clean(served.engine)


def test_a_fork_of_a_session_with_an_engine_session_prefills_its_prefix_once(served: Served) -> None:
    """SGLang's streaming session keeps its turns' KV in its own slot (only the session's first prompt reaches the
    radix tree) and cannot be branched, so a fork of a parent that has one has the engine prefill the forked prefix
    once (turns/prefill.py): each child's next turn, opening an engine session of its own with its whole prompt,
    finds the parent's history in the radix cache but its last token or two (its stop token replaced, the last
    sampled token never computed)."""
    parent = new_session(served.server)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Keep answers short. " + " ".join(f"note {i}." for i in range(60))}]
    for turn in range(3):  # the first without an engine session, the second opens it, the third appends
        history.append({"role": "user", "content": f"Turn {turn}: tell me more."})
        r = chat(served.server, parent, history)
        assert r.status_code == 200, r.text
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    served.proxy.clear()
    fork = httpx.post(f"{served.server}/sessions/{parent}/fork", json={"n": 2}, timeout=300)
    assert fork.status_code == 200, fork.text
    position = fork.json()["fork_position"]
    assert fork.json()["prefill"]["prompt_tokens"] == position
    (prefill,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert prefill["request"]["sampling_params"]["max_new_tokens"] == 0 and "session_params" not in prefill["request"]
    served.proxy.clear()
    children = fork.json()["session_ids"]
    for i, child in enumerate(children):
        r = chat(served.server, child, [*history, {"role": "user", "content": f"Branch {i}: go on."}])
        assert r.status_code == 200, r.text
    generates = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert len(generates) == 2
    for call in generates:
        assert call["response"]["meta_info"]["cached_tokens"] >= position - 2, (position, call["response"]["meta_info"])
    for sid in (parent, *children):
        assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204
    assert_engine_clean(served.engine)


def test_engine_sigkill_mid_turn_then_restart(serve: ServeFactory, engines: Engines) -> None:
    """No proxy here: the server must see the engine's connection die, as it would in production."""
    with serve("dense", "--engine-sessions", proxied=False) as s:
        sid = new_session(s.server)
        first = [{"role": "user", "content": "Hello there."}]
        r = chat(s.server, sid, first)
        assert r.status_code == 200, r.text
        history = [*first, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                   {"role": "user", "content": "Now write a very long essay."}]
        engine = engines.get("dense")

        async def killed_mid_turn() -> httpx.Response:
            async with httpx.AsyncClient(timeout=120) as http:
                turn = asyncio.create_task(http.post(chat_url(s.server, sid), json={
                    "messages": history, "temperature": 0, "max_tokens": 1500}))
                async with asyncio.timeout(120):
                    await wait_loads(engine.url, lambda report: report["num_running_reqs"] >= 1)
                engine.kill()  # SIGKILL to the launcher, scheduler and detokenizer at once
                return await asyncio.wait_for(turn, 60)

        started = time.monotonic()
        # Paced (SGLang's own /slow_down): the 1500-token turn takes at least 150 s on any machine, so the kill lands
        # in the middle of it. The pace dies with the engine: the restarted one runs at full speed.
        with paced(engine.url, 0.1):
            failed = asyncio.run(killed_mid_turn())
        assert failed.status_code in (502, 503), failed.text  # the engine is gone: an engine error, not the agent's
        assert time.monotonic() - started < 60
        records = httpx.get(f"{s.server}/sessions/{sid}", timeout=10).json()["records"]
        assert len(records) == 1  # nothing of the killed turn was committed

        engine = engines.start("dense", port=engine.port)  # back where the server expects it, with no sessions
        opened_before = engine_log_count(engines, "Session opened")
        retry = chat(s.server, sid, history)
        assert retry.status_code == 200, retry.text
        records = httpx.get(f"{s.server}/sessions/{sid}", timeout=10).json()["records"]
        assert len(records) == 2 and records[1]["prompt_len"] > records[0]["prompt_len"]
        # The turn ran in a new engine session on the restarted engine (the server's old one died with it).
        assert engine_log_count(engines, "Session opened", opened_before + 1) == opened_before + 1
        assert httpx.delete(f"{s.server}/sessions/{sid}", timeout=30).status_code == 204
        assert_engine_clean(engine.url)


def engine_log_count(engines: Engines, text: str, expected: int = 0, timeout: float = 30.0) -> int:
    """How often the dense engine has logged `text`, once it has logged it at least `expected` times (or `timeout`
    passed): the scheduler writes its line after the reply has left."""
    proc = engines.running["dense"]
    assert proc.log_path is not None
    deadline = time.monotonic() + timeout
    while (count := proc.log_path.read_text(errors="replace").count(text)) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return count
