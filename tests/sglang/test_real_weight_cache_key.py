"""Issue 38 on released SGLang 0.5.23: weights pushed while a reply runs, with the radix cache on, leave every token
exact; the same requests without a cache key reuse the old weights' KV and are not.

A long greedy reply streams while the server pushes the second checkpoint (`/admin/pause` in_place, which cuts the
engine's requests by default, `update_weights_from_disk` in place without a flush, `/admin/continue` with the
version). The reply's continuation, and another session's new turn with the same prompt, are keyed by the new
version; each must equal a reference, the same request on a cache partition nothing else used (0 cached tokens),
within 1e-3. The control: before the push the prompt is cached without a key (the old weights' KV); after it the
same request without a key reuses that prefix and its logprobs are off the reference by far more than 1e-3 (the two
checkpoints are unrelated random weights). Paced (`paced`): the reply's MAX_TOKENS take at least MAX_TOKENS * PACE s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from support.server import chat_url, new_session
from support.sglang_engine import Engines, Served, ServeFactory, assert_engine_clean, paced

MAX_TOKENS = 300
PACE = 0.05
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


@pytest.fixture(scope="module")
def served(serve: ServeFactory, engines: Engines) -> Iterator[Served]:
    with serve("dense") as s:
        try:
            yield s
        finally:
            httpx.post(f"{s.engine}/continue_generation", json={}, timeout=30)
            assert_engine_clean(s.engine)
            r = httpx.post(f"{s.engine}/update_weights_from_disk", timeout=300, json={
                "model_path": str(engines.checkpoint("qwen3-dense")), "weight_version": "default",
                "flush_cache": True})
            assert r.status_code == 200 and r.json()["success"], r.text


def _generate(engine: str, body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """`body` straight to the engine, unstreamed, under a new rid, with `changes` (None leaves a key out)."""
    sent = {k: v for k, v in {**body, "rid": f"ref-{time.monotonic_ns()}", "stream": False, **changes}.items()
            if v is not None}
    sent["sampling_params"] = {k: v for k, v in sent["sampling_params"].items() if k != "stream_interval"}
    r = httpx.post(f"{engine}/generate", json=sent, timeout=300)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _logprobs(reply: dict[str, Any]) -> np.ndarray:
    return np.asarray([e[0] for e in reply["meta_info"]["output_token_logprobs"]], np.float64)


def test_a_push_mid_reply_with_the_cache_on_is_exact_and_the_keyless_control_is_not(
        served: Served, engines: Engines) -> None:
    server, engine, proxy = served.server, served.engine, served.proxy
    a, b = new_session(server), new_session(server)
    proxy.clear()
    second = str(engines.checkpoint("qwen3-dense-b"))
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True}

    async def reply_with_a_push() -> list[str]:
        async with httpx.AsyncClient(timeout=600) as http, http.stream("POST", chat_url(server, a),
                                                                         json=body) as reply:
            assert reply.status_code == 200
            lines = reply.aiter_lines()
            seen = [await anext(line async for line in lines if line.startswith("data:"))]
            first = proxy.calls[0]["request"]
            # the control's prime: the prompt cached without a key, by the old weights
            await asyncio.to_thread(_generate, engine, first, extra_key=None,
                                    sampling_params={"max_new_tokens": 1, "temperature": 0})
            try:
                paused = await http.post(f"{server}/admin/pause", json={"mode": "in_place"})
                assert paused.status_code == 200, paused.text
                r = await http.post(f"{engine}/update_weights_from_disk", timeout=300, json={
                    "model_path": second, "weight_version": "ck-2", "flush_cache": False,
                    "abort_all_requests": False})
                assert r.status_code == 200 and r.json()["success"], r.text  # nothing ran: the update went through
            finally:
                resumed = await http.post(f"{server}/admin/continue", json={"weight_version": "ck-2"})
            assert resumed.status_code == 200, resumed.text
            seen += [line async for line in lines if line.startswith("data:")]
            return seen

    with paced(engine, PACE):
        lines = asyncio.run(reply_with_a_push())
    assert lines[-1].strip() == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    calls = [c for c in proxy.settled() if c["path"] == "/generate"]
    assert len(calls) == 2, [c["response"]["meta_info"]["finish_reason"] for c in calls]
    cut, rest = calls
    assert cut["request"]["extra_key"] == "weights:default"
    assert cut["response"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert rest["request"]["extra_key"] == "weights:ck-2" and rest["response"]["meta_info"]["weight_version"] == "ck-2"
    assert rest["request"]["input_ids"] == cut["request"]["input_ids"] + cut["response"]["output_ids"]
    reference = _generate(engine, rest["request"], extra_key="reference:rest")
    assert reference["output_ids"] == rest["response"]["output_ids"]
    assert np.abs(_logprobs(rest["response"]) - _logprobs(reference)).max() <= 1e-3

    # another session's turn with the same prompt: keyed by the new weights, exact
    proxy.clear()
    turn_body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 24}
    assert httpx.post(chat_url(server, b), json=turn_body, timeout=300).status_code == 200
    (turn,) = [c for c in proxy.settled() if c["path"] == "/generate"]
    assert turn["request"]["extra_key"] == "weights:ck-2"
    reference = _generate(engine, turn["request"], extra_key="reference:turn")
    assert reference["meta_info"]["cached_tokens"] == 0
    exact = np.abs(_logprobs(turn["response"]) - _logprobs(reference)).max()
    assert exact <= 1e-3

    # the control: the same request without a key reuses the prefix the old weights computed
    control = _generate(engine, turn["request"], extra_key=None)
    prompt = len(turn["request"]["input_ids"])
    assert control["meta_info"]["cached_tokens"] >= prompt - 1, control["meta_info"]["cached_tokens"]
    n = min(len(control["output_ids"]), len(reference["output_ids"]))
    off = float(np.abs(_logprobs(control)[:1] - _logprobs(reference)[:1]).max())  # the first token: same context
    print(json.dumps({"exact_max": float(exact), "control_first_token_off": off,
                      "control_cached": control["meta_info"]["cached_tokens"], "prompt": prompt, "n": n}))
    assert off > 1e-2, off
    for sid in (a, b):
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204
