"""A real weight update mid-generation loses no turn: `POST /admin/pause` mode `in_place` pauses SGLang in place
(`/pause_generation` mode `in_place`: running requests keep their KV), the trainer loads a second random checkpoint
with SGLang's `/update_weights_from_disk`, `POST /admin/continue` resumes the engine, and the in-flight chat ends as
one reply whose tokens are each recorded with the weight version that sampled them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from support.server import assert_sample_is_what_the_engine_saw, chat_url, new_session
from support.sglang_engine import Engines, Served, ServeFactory, assert_engine_clean, wait_loads
from trajectory import samples_from_json

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense") as s:
        yield s


def update_weights(engine: str, checkpoint: str, version: str, flush: bool) -> None:
    r = httpx.post(f"{engine}/update_weights_from_disk", timeout=300, json={
        "model_path": checkpoint, "weight_version": version, "flush_cache": flush})
    assert r.status_code == 200 and r.json()["success"], r.text


def test_in_place_pause_and_a_real_weight_update_keep_the_turn(served: Served, engines: Engines) -> None:
    sid, other = new_session(served.server), new_session(served.server)
    served.proxy.clear()
    second = str(engines.checkpoint("qwen3-dense-b"))

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=600) as http:
            chat = asyncio.create_task(http.post(chat_url(served.server, sid), json={
                "messages": [{"role": "user", "content": "Write a long story."}], "temperature": 0,
                "max_tokens": MAX_TOKENS}))
            async with asyncio.timeout(120):
                await wait_loads(served.engine, lambda report: report["num_running_reqs"] >= 1)
            await asyncio.sleep(1.0)  # some tokens under the first weights
            paused = await http.post(f"{served.server}/admin/pause", json={"mode": "in_place"})
            assert paused.status_code == 200, paused.text
            refused = await http.post(chat_url(served.server, other), json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert refused.status_code == 503
            await asyncio.to_thread(update_weights, served.engine, second, "step-2", False)
            assert not chat.done()
            resumed = await http.post(f"{served.server}/admin/continue")
            assert resumed.status_code == 200, resumed.text
            return await chat

    reply = asyncio.run(main())
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
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
    # Back to the first weights for the rest of the run (nothing runs now: the cache is flushed with them).
    assert_engine_clean(served.engine)
    update_weights(served.engine, str(engines.checkpoint("qwen3-dense")), "default", True)
