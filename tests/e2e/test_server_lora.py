"""LoRA per session against the sim (issue 40; the real engine: tests/sglang/test_real_lora.py).

The sim serves adapters as SGLang 0.5.23 does (sglang_sim/lora.py: `lora_path`, load / unload, replies of their own,
cache entries of their own, an unloaded adapter reloaded when a request names it). Through the server: every engine
request of a session names the adapter revision it is pinned to (and its cache key says so), the samples record it
per turn, an adapter the engine lacks is refused before any engine call, a pushed revision pins new sessions while
the old ones finish under theirs, and a superseded revision is unloaded once no session holds it and never named
again; a server whose --lora-adapter the engine lacks does not start.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.launchers import start_session_server
from rollout.weight_push import WeightPusher, WeightPushError
from support.server import chat_url, new_session
from support.stack import Stack, StackFactory
from trajectory import samples_from_json

FAMILY = "qwen3"
CHAT = {"messages": [{"role": "user", "content": "hello there [[sim: tokens 6]]"}], "max_tokens": 16}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    sim = ["--enable-lora", "--lora-paths", "a1=/adapters/a1", "a2=/adapters/a2", "--max-loaded-loras", "3",
           "--max-loras-per-batch", "3"]
    with stack_factory(family=FAMILY, sim_args=sim, proxied={"server", "latest"},
                       servers={"server": [],
                                # one engine, three servers: only `server` unloads what its sessions no longer hold
                                "latest": ["--adapter-revisions", "latest", "--keep-adapter-revisions"],
                                "default": ["--lora-adapter", "a2", "--keep-adapter-revisions"]}) as stack:
        yield stack


def _chat(server: str, sid: str, **extra: Any) -> httpx.Response:
    return httpx.post(chat_url(server, sid), json={**CHAT, **extra}, timeout=60)


def _generates(stack: Stack, sid: str, since: int = 0) -> list[dict[str, Any]]:
    assert stack.proxy is not None
    return [c["request"] for c in stack.proxy.calls[since:] if c["path"] == "/generate" and c["routing_key"] == sid]


def _adapters(stack: Stack) -> set[str]:
    data = httpx.get(f"{stack.engine}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def _samples(server: str, sid: str) -> list[Any]:
    r = httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=30)
    assert r.status_code == 200, r.text
    return samples_from_json(r.json())


def test_each_session_names_its_adapter_on_every_engine_call(stack: Stack) -> None:
    base = new_session(stack.server)
    a1 = new_session(stack.server, {"lora_adapter": "a1"})
    a2 = new_session(stack.server)
    replies = {}
    for sid, model in ((base, "qwen3"), (a1, "qwen3"), (a2, "qwen3:a2")):
        r = _chat(stack.server, sid, model=model)
        assert r.status_code == 200, r.text
        replies[sid] = r.json()["choices"][0]["message"]["content"]
        r = _chat(stack.server, sid, model=model, messages=[*CHAT["messages"], r.json()["choices"][0]["message"],
                                                            {"role": "user", "content": "more [[sim: tokens 4]]"}])
        assert r.status_code == 200, r.text
    assert len(set(replies.values())) == 3  # each adapter its own reply, the base model another
    for sid, path in ((base, None), (a1, "a1"), (a2, "a2")):
        sent = _generates(stack, sid)
        assert [g.get("lora_path") for g in sent] == [path, path]
        key = "weights:default" if path is None else f"weights:default|lora:{path}"
        assert {g["extra_key"] for g in sent} == {key}
    (merged,) = _samples(stack.server, a1)
    assert merged.metadata["adapters"] == [["a1", "0"], ["a1", "0"]]
    (merged,) = _samples(stack.server, base)
    assert merged.metadata["adapters"] == [None, None]  # a base turn says so
    records = httpx.get(f"{stack.server}/sessions/{a2}", timeout=10).json()["records"]
    assert [(r["adapter"], r["adapter_revision"]) for r in records] == [("a2", "0")] * 2
    # pinned: the model field may not switch a session to another adapter
    r = _chat(stack.server, a1, model="qwen3:a2")
    assert r.status_code == 400 and "pinned to 'a1'" in r.text, r.text
    for sid in (base, a1, a2):  # what a later test unloads must not be held here
        assert httpx.delete(f"{stack.server}/sessions/{sid}", timeout=10).status_code == 204


def test_an_adapter_the_engine_lacks_is_refused_before_any_engine_call(stack: Stack) -> None:
    assert stack.proxy is not None
    sid = new_session(stack.server, {"lora_adapter": "nope"})
    before = len(stack.proxy.calls)
    r = _chat(stack.server, sid)
    assert r.status_code == 404 and "nope" in r.text, r.text
    assert _generates(stack, sid, before) == []
    r = _chat(stack.server, new_session(stack.server), model="qwen3:missing")
    assert r.status_code == 404 and "missing" in r.text, r.text


def test_the_default_adapter_and_its_startup_check(stack: Stack) -> None:
    sid = new_session(stack["default"])
    r = _chat(stack["default"], sid)
    assert r.status_code == 200, r.text
    (merged,) = _samples(stack["default"], sid)
    assert merged.metadata["adapters"] == [["a2", "0"]]
    assert new_session(stack["default"], {"lora_adapter": ""})  # "" asks for the base model
    refused = start_session_server(stack.engine, stack.tok, FAMILY, "--lora-adapter", "a9", log_dir=stack.logs,
                                   name="no-a9", wait=False)
    try:
        assert refused.proc.wait(60) != 0
        assert "--lora-adapter 'a9'" in "\n".join(refused.output)
    finally:
        refused.stop()


def test_revisions_pinned_then_unloaded_and_never_named_again(stack: Stack) -> None:
    """server: pinned (an old session stays on a1 revision 0); latest: its session moves on at its next turn."""
    assert stack.proxy is not None
    old = new_session(stack.server, {"lora_adapter": "a1"})
    moving = new_session(stack["latest"], {"lora_adapter": "a1"})
    history = {}
    for server, sid in ((stack.server, old), (stack["latest"], moving)):
        r = _chat(server, sid)
        assert r.status_code == 200, r.text
        history[sid] = [*CHAT["messages"], r.json()["choices"][0]["message"], {"role": "user", "content": "on"}]

    async def push() -> None:
        async with WeightPusher(stack.engine, [stack.server, stack["latest"], stack["default"]]) as pusher:
            result = await pusher.push_adapter("/adapters/a1-r1", "a1", "1")
            assert result.engine_name == "a1@1"
            with pytest.raises(WeightPushError, match="already holds adapter 'a1@1'"):
                await pusher.push_adapter("/adapters/a1-r1", "a1", "1")

    asyncio.run(push())
    books = httpx.get(f"{stack.server}/admin/sessions", timeout=10).json()["adapters"]
    assert books == {"loaded": ["a1", "a1@1", "a2"], "current": {"a1": "1", "a2": "0"}, "pinned": {"a1": 1},
                     "unloaded": []}
    mark = len(stack.proxy.calls)
    for server, sid in ((stack.server, old), (stack["latest"], moving)):
        assert _chat(server, sid, messages=history[sid]).status_code == 200
    new = new_session(stack.server, {"lora_adapter": "a1"})
    assert _chat(stack.server, new).status_code == 200
    assert [g["lora_path"] for g in _generates(stack, old, mark)] == ["a1"]  # pinned: finishes under revision 0
    assert [g["lora_path"] for g in _generates(stack, moving, mark)] == ["a1@1"]  # latest: moves on
    assert [g["lora_path"] for g in _generates(stack, new, mark)] == ["a1@1"]
    (merged,) = _samples(stack["latest"], moving)
    assert merged.metadata["adapters"] == [["a1", "0"], ["a1", "1"]]
    # The engine is full (a1, a2, a1@1 of --max-loaded-loras 3): a push would evict one, so it is refused.
    with pytest.raises(WeightPushError, match="--max-loaded-loras 3"):
        asyncio.run(_push(stack, "a2", "1"))
    assert "a1" in _adapters(stack)  # `old` holds revision 0 on `server`
    assert httpx.delete(f"{stack.server}/sessions/{old}", timeout=10).status_code == 204
    _until(lambda: "a1" not in _adapters(stack))
    mark = len(stack.proxy.calls)
    late = new_session(stack.server, {"lora_adapter": "a1"})
    assert _chat(stack.server, late).status_code == 200
    assert _chat(stack.server, new).status_code == 200
    assert {g["lora_path"] for c in (late, new) for g in _generates(stack, c, mark)} == {"a1@1"}
    assert "a1" not in _adapters(stack)  # nothing named it: the sim would have reloaded it, as 0.5.23 does


async def _push(stack: Stack, name: str, revision: str) -> None:
    async with WeightPusher(stack.engine, [stack.server]) as pusher:
        await pusher.push_adapter(f"/adapters/{name}-r{revision}", name, revision)


def _until(condition: Any, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def _stream_chunks(server: str, sid: str) -> list[dict[str, Any]]:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    with httpx.stream("POST", chat_url(server, sid), json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_streamed_reply_names_its_adapter_revision_as_a_plain_one_does(stack: Stack) -> None:
    """ART's policy spans (chat/policy_spans.py) on the finishing chunk of a streamed turn on an adapter: the same
    two lists a plain reply of the session carries, covering the streamed reply's own prompt and completion; a base
    session's stream carries none."""
    a1 = new_session(stack.server, {"lora_adapter": "a1"})
    plain = _chat(stack.server, a1, return_token_ids=True)
    assert plain.status_code == 200, plain.text
    (plain_choice,) = plain.json()["choices"]
    streamed_sid = new_session(stack.server, {"lora_adapter": "a1"})
    chunks = _stream_chunks(stack.server, streamed_sid)
    with_spans = [c for c in chunks for choice in c["choices"] if "policy_token_spans" in choice]
    assert len(with_spans) == 1 and with_spans[0]["choices"][0]["finish_reason"] is not None
    (choice,) = with_spans[0]["choices"]
    usage = chunks[-1]["usage"]
    (record,) = httpx.get(f"{stack.server}/sessions/{streamed_sid}", timeout=10).json()["records"]
    assert record["adapter"] == "a1"
    revision = int(record["adapter_revision"])  # the latest a1 when the session began (a test above may push one)
    assert len(choice["token_ids"]) == usage["completion_tokens"]
    assert len(with_spans[0]["prompt_token_ids"]) == usage["prompt_tokens"]
    for name, start, end in (("policy_token_spans", 0, usage["completion_tokens"]),
                             ("prompt_policy_token_spans", 1, usage["prompt_tokens"])):
        (span,) = choice[name]
        assert (span["start_token"], span["end_token"]) == (start, end)
        assert span["lora_slot"].split("@")[0] == "a1" and span["policy_version"] == span["update_seq"] == revision
        (plain_span,) = plain_choice[name]
        assert {k: v for k, v in span.items() if k != "generation_id"} == {
            k: v for k, v in plain_span.items() if k != "generation_id"}  # the same prompt, the same reply length
    base = new_session(stack.server)
    base_chunks = _stream_chunks(stack.server, base)
    assert not any("policy_token_spans" in choice for c in base_chunks for choice in c["choices"])
    for sid in (a1, streamed_sid, base):
        assert httpx.delete(f"{stack.server}/sessions/{sid}", timeout=10).status_code == 204
