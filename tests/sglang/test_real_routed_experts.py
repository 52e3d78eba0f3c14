"""Routed experts (MoE routing replay) from the real engine: a tiny random Qwen3-MoE (2 layers, 4 experts, top-2)
served with `--enable-return-routed-experts`, the session server with `--return-routed-experts`.

Each turn asks only for the rows it does not hold yet (`routed_experts_start_len` = the positions already covered),
SGLang answers base64 int32 `[prompt + completion - 1 - start_len, layers, top_k]`, and the sample stitches the turns
into one `[len(tokens), layers * top_k]` array (-1 on the last token, which no forward pass has routed yet). The
stitched rows must equal the routing of the whole sequence computed at once: the same tokens sent again after a cache
flush, in one prefill.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from support.server import assert_sample_is_what_the_engine_saw, chat_url, new_session
from support.sglang_engine import Served, ServeFactory, assert_engine_clean
from trajectory import samples_from_json

LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("moe", "--return-routed-experts") as s:
        yield s


def decode(payload: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(payload), dtype=np.int32).reshape(-1, LAYERS, TOP_K)


def test_routed_experts_per_turn_stitch_to_the_full_sequence_routing(served: Served) -> None:
    sid = new_session(served.server)
    served.proxy.clear()
    history: list[dict[str, Any]] = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Turn {turn}: and then?"})
        r = httpx.post(chat_url(served.server, sid), json={"messages": history, "temperature": 0, "max_tokens": 6},
                       timeout=300)
        assert r.status_code == 200, r.text
        assert "routed_experts" not in r.text  # the agent never gets the replay payload
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    calls = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    covered = 0
    for call in calls:
        req, meta = call["request"], call["response"]["meta_info"]
        assert req["return_routed_experts"] is True
        assert req.get("routed_experts_start_len", 0) == covered  # only the rows not held yet
        rows = decode(meta["routed_experts"])
        total = len(req["input_ids"]) + meta["completion_tokens"] - 1
        assert rows.shape == (total - covered, LAYERS, TOP_K)
        assert rows.min() >= 0 and rows.max() < EXPERTS
        assert all(len(set(r)) == TOP_K for r in rows.reshape(-1, TOP_K).tolist())  # top-k picks distinct experts
        covered = total

    sample = samples_from_json(httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
    assert_sample_is_what_the_engine_saw(sample, calls)
    stitched = sample.routed_experts
    assert stitched is not None and stitched.shape == (len(sample.tokens), LAYERS * TOP_K)
    assert (stitched[-1] == -1).all() and (stitched[:-1] >= 0).all()

    # The whole sequence at once, nothing cached: one prefill routes every position.
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204
    assert_engine_clean(served.engine)  # also flushes the radix cache
    full = httpx.post(f"{served.engine}/generate", timeout=300, json={
        "input_ids": sample.tokens.tolist(), "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_routed_experts": True})
    assert full.status_code == 200, full.text
    assert full.json()["meta_info"]["cached_tokens"] == 0
    at_once = decode(full.json()["meta_info"]["routed_experts"]).reshape(-1, LAYERS * TOP_K)
    assert at_once.shape == (len(sample.tokens), LAYERS * TOP_K)
    # Expert ids per token and layer, compared as sets (SGLang orders a token's top-k by weight).
    a = np.sort(stitched[:-1].reshape(-1, LAYERS, TOP_K), axis=-1)
    b = np.sort(at_once[:-1].reshape(-1, LAYERS, TOP_K), axis=-1)
    mismatched = np.argwhere((a != b).any(axis=-1))
    assert len(mismatched) == 0, f"{len(mismatched)} (position, layer) routings differ: {mismatched[:10].tolist()}"
