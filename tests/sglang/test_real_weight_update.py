"""A real weight update mid-generation loses no turn: `POST /admin/pause` mode `in_place` pauses SGLang in place
(`/pause_generation` mode `in_place`: running requests keep their KV), the trainer loads a second random checkpoint
with SGLang's `/update_weights_from_disk`, `POST /admin/continue` resumes the engine, and the in-flight chat ends as
one reply whose tokens are each recorded with the weight version that sampled them.

The reply is long by construction: the engine runs paced (`paced`, SGLang's own `/slow_down`), so its MAX_TOKENS
take at least MAX_TOKENS * PACE = 20 s on any machine, and what a test does as the first tokens arrive lands in the
middle of the reply, not after its end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from support.server import assert_sample_is_what_the_engine_saw, chat_url, new_session
from support.sglang_engine import Engines, Served, ServeFactory, assert_engine_clean, paced
from trajectory import samples_from_json

MAX_TOKENS = 400
PACE = 0.05  # seconds per engine step


async def _chunks(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The stream's JSON chunks, up to `[DONE]`."""
    async for line in lines:
        if line.startswith("data:"):
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def _content(chunk: dict[str, Any]) -> bool:
    return any(choice["delta"].get("content") or choice["delta"].get("reasoning_content")
               for choice in chunk.get("choices", []))


async def _long_story(served: Served, sid: str, during: Callable[[httpx.AsyncClient], Awaitable[None]]
                      ) -> list[dict[str, Any]]:
    """Stream a long greedy reply and run `during` as soon as its first tokens arrive (so what it does lands early in
    the reply on any machine, not after a fixed sleep that a fast one outruns); return the stream's chunks."""
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=600) as http, http.stream("POST", chat_url(served.server, sid),
                                                                     json=body) as reply:
        assert reply.status_code == 200
        lines = reply.aiter_lines()
        chunks = [await anext(chunk async for chunk in _chunks(lines) if _content(chunk))]
        await during(http)
        chunks += [chunk async for chunk in _chunks(lines)]
        return chunks


@pytest.fixture(scope="module")
def served(serve: ServeFactory, engines: Engines) -> Iterator[Served]:
    """The dense engine is shared with the tier's other modules: whatever a test here leaves behind (a pause, the
    second weights), they get it back running on the first weights. The server runs `--straddled-replies keep`: this
    module measures SGLang's own in-place run (test_real_weight_cache_key.py the default, exact path)."""
    with serve("dense", "--straddled-replies", "keep") as s:
        try:
            with paced(s.engine, PACE):
                yield s
        finally:
            httpx.post(f"{s.engine}/continue_generation", json={}, timeout=30)
            assert_engine_clean(s.engine)
            update_weights(s.engine, str(engines.checkpoint("qwen3-dense")), "default", True)


def update_weights(engine: str, checkpoint: str, version: str, flush: bool) -> None:
    r = httpx.post(f"{engine}/update_weights_from_disk", timeout=300, json={
        "model_path": checkpoint, "weight_version": version, "flush_cache": flush})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_in_place_pause_and_a_real_weight_update_keep_the_turn(served: Served, engines: Engines) -> None:
    sid, other = new_session(served.server), new_session(served.server)
    served.proxy.clear()
    second = str(engines.checkpoint("qwen3-dense-b"))

    async def update_in_place(http: httpx.AsyncClient) -> None:
        try:
            paused = await http.post(f"{served.server}/admin/pause", json={"mode": "in_place"})
            assert paused.status_code == 200, paused.text
            refused = await http.post(chat_url(served.server, other), json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert refused.status_code == 503
            await asyncio.to_thread(update_weights, served.engine, second, "step-2", False)
        finally:
            resumed = await http.post(f"{served.server}/admin/continue")
        assert resumed.status_code == 200, resumed.text

    chunks = asyncio.run(_long_story(served, sid, update_in_place))
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    (call,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    versions = call["response"]["meta_info"]["weight_versions"]
    assert [v["version"] for v in versions] == ["default", "step-2"], versions
    sample = samples_from_json(httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
    (start, end), = assert_sample_is_what_the_engine_saw(sample, [call])
    spans = sample.metadata["weight_version_spans"]
    assert [v for v, _, _ in spans] == ["default", "step-2"]
    assert spans[0][1] == start and spans[0][2] == spans[1][1] and spans[1][2] == end
    assert start < spans[0][2] < end  # tokens of both versions in the one reply
    covered = np.concatenate([np.arange(a, b) for _, a, b in spans])
    assert np.array_equal(covered, np.flatnonzero(sample.loss_mask))
    for s in (sid, other):
        assert httpx.delete(f"{served.server}/sessions/{s}", timeout=30).status_code == 204


def test_a_real_weight_update_that_aborts_the_reply_is_continued(served: Served, engines: Engines) -> None:
    """The trainer loads the second checkpoint with `abort_all_requests` (no pause): SGLang aborts the streamed reply
    mid-generation, the server resubmits prompt + the tokens already sampled, and the agent's stream simply goes on
    to the full `max_tokens`; the sample is both requests' tokens and logprobs, each with its weight version."""
    sid = new_session(served.server)
    served.proxy.clear()
    second = str(engines.checkpoint("qwen3-dense-b"))

    async def update_aborting(http: httpx.AsyncClient) -> None:
        r = await http.post(f"{served.engine}/update_weights_from_disk", timeout=300, json={
            "model_path": second, "weight_version": "step-3", "flush_cache": False, "abort_all_requests": True})
        assert r.status_code == 200 and r.json()["success"], r.text

    try:
        chunks = asyncio.run(_long_story(served, sid, update_aborting))
    finally:
        update_weights(served.engine, str(engines.checkpoint("qwen3-dense")), "default", True)
    assert not any("error" in chunk for chunk in chunks), chunks[-3:]
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    cut, rest = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    finish = cut["response"]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["message"] == "Aborted" and finish["status_code"] is None, finish
    sampled = len(cut["response"]["output_ids"])
    assert 0 < sampled < MAX_TOKENS
    assert rest["request"]["input_ids"] == cut["request"]["input_ids"] + cut["response"]["output_ids"]
    assert rest["request"]["sampling_params"]["max_new_tokens"] == MAX_TOKENS - sampled
    assert rest["response"]["meta_info"]["weight_version"] == "step-3"
    sample = samples_from_json(httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
    (start, middle), (_, end) = assert_sample_is_what_the_engine_saw(sample, [cut, rest])
    # Each token's version as the engine reported it: the cut's are the weights before the update (whichever the
    # module's earlier test left), the continuation's the new ones.
    metas = [cut["response"]["meta_info"], rest["response"]["meta_info"]]
    expected: list[list[Any]] = []
    for meta, offset in zip(metas, (start, middle), strict=True):
        for span in meta.get("weight_versions") or [{"version": meta["weight_version"], "start": 0,
                                                     "end": meta["completion_tokens"]}]:
            version, a, b = span["version"], span["start"] + offset, span["end"] + offset
            if expected and expected[-1][0] == version and expected[-1][2] == a:
                expected[-1][2] = b
            else:
                expected.append([version, a, b])
    assert sample.metadata["weight_version_spans"] == expected, metas
    assert [v for v, _, _ in expected][-2:] == [metas[0]["weight_version"], "step-3"], expected
    assert expected[0][1] == start and expected[-1][2] == end
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204
