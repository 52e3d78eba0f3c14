"""Routed experts and weight versions as released SGLang 0.5.23 returns them, delivered in samples (issue 9 points 3
and 7).

Routed experts: base64 int32 [rows, layers, top_k] for positions [routed_experts_start_len, seqlen - 1)
(batch_result_processor.py `_maybe_collect_routed_experts`, detokenizer_manager.py `_b64_encode_per_request`). The
server asks each turn only for the positions its records do not cover yet, cuts the string out of the body before
decoding the rest, and delivers one int32 tensor aligned with the sample's tokens. Weight versions:
utils/weight_versions.py spans per output token, delivered as spans on the sample's positions.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from sglang_sim.routed_experts import routing
from support.server import chat_url, new_session, wait_emitted, wait_running
from support.stack import Stack, StackFactory
from trajectory import samples_from_json, samples_from_safetensors

FAMILY = "qwen3"
LAYERS, TOP_K = 3, 2


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--routed-experts-layers", str(LAYERS), "--routed-experts-top-k", str(TOP_K),
                  "--enable-streaming-session", "--token-latency-ms", "2"],
        servers={"server": ["--return-routed-experts"], "es": ["--return-routed-experts", "--engine-sessions"]},
        proxied={"server", "es"},
    ) as stack:
        yield stack


def _episode(server: str, sid: str, turns: int) -> None:
    history: list[dict[str, Any]] = []
    for i in range(turns):
        history.append({"role": "user", "content": f"turn {i} [[sim: tokens 6]]"})
        r = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
        assert r.status_code == 200, r.text
        assert "routed_experts" not in r.text  # never sent to the agent
        history.append(r.json()["choices"][0]["message"])


@pytest.mark.parametrize("name", ["server", "es"])
def test_routed_experts_incremental_and_aligned_in_samples(stack: Stack, name: str) -> None:
    server = stack[name]
    assert stack.proxy is not None
    stack.proxy.clear()
    sid = new_session(server)
    _episode(server, sid, 3)
    gens = [c for c in stack.proxy.generates() if c["routing_key"] == sid]
    assert len(gens) == 3 and gens[0]["request"]["routed_experts_start_len"] == 0
    for prev, cur in itertools.pairwise(gens):
        covered = prev["request"]["routed_experts_start_len"] + len(base64.b64decode(
            prev["response"]["meta_info"]["routed_experts"])) // (4 * LAYERS * TOP_K)
        assert 0 < cur["request"]["routed_experts_start_len"] == covered  # only what is new is asked for
        assert isinstance(cur["response"]["meta_info"]["routed_experts"], str)

    tokens = np.asarray(httpx.get(f"{server}/sessions/{sid}").json()["token_ids"], dtype=np.int32)
    want = np.full((len(tokens), LAYERS * TOP_K), -1, dtype=np.int32)
    want[:-1] = routing(tokens[:-1], LAYERS, TOP_K).reshape(len(tokens) - 1, -1)
    as_json = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}).json())
    binary = samples_from_safetensors(httpx.post(f"{server}/sessions/{sid}/samples", json={},
                                                 headers={"Accept": "application/octet-stream"}).content)
    for sample in (as_json[0], binary[0]):
        assert sample.routed_experts is not None and np.array_equal(sample.routed_experts, want)
    cut = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={"max_seq_len": 20}).json())[0]
    assert cut.routed_experts is not None and len(cut.routed_experts) == len(cut.tokens)
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_weight_versions_per_token_in_samples(stack: Stack) -> None:
    """A weight update while a turn generates: the sample says which version sampled which token."""
    server = stack.server
    sid = new_session(server)
    _episode(server, sid, 1)

    first = httpx.get(f"{server}/sessions/{sid}").json()["records"][0]["message"]

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            history = [{"role": "user", "content": "turn 0 [[sim: tokens 6]]"}]
            # 3 s at the engine: the update lands long before its end, after some tokens (counted, not slept for)
            history += [first, {"role": "user", "content": "long [[sim: tokens 1500]]"}]
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json={"messages": history}))
            await wait_running(stack.engine)
            await asyncio.to_thread(wait_emitted, stack.engine, 20)
            r = await http.post(f"{stack.engine}/update_weight_version",
                                json={"new_version": "step-2", "abort_all_requests": False})
            assert r.status_code == 200
            assert (await chat).status_code == 200

    asyncio.run(main())
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}).json())[0]
    spans = sample.metadata["weight_version_spans"]
    assert [s[0] for s in spans] == ["default", "default", "step-2"]
    assert spans[1][2] == spans[2][1]  # the second turn's tokens: a run of each version, back to back
    sampled = np.flatnonzero(sample.loss_mask)
    covered = np.concatenate([np.arange(a, b) for _, a, b in spans])
    assert np.array_equal(np.sort(covered), sampled)  # every sampled token has its version, nothing else
    httpx.post(f"{stack.engine}/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
