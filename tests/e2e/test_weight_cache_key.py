"""Exact samples while the weights change, with the radix cache on (issue 38), against the sim.

The sim partitions its radix cache by `extra_key` as SGLang 0.5.23 does and moves its logprobs with the weights
(sglang_sim.engine.weight_shift), plus STALE_KV_SHIFT for a token sampled on KV other weights computed, so stale KV
shows in the logprobs here as it does on the real engine (tests/sglang/test_real_weight_cache_key.py). A reply runs
while new weights are pushed through the server (pause in_place, the engine's update in place, continue with the
version); then a new turn of another session with the same prompt. Each engine reply must equal a reference: the same
request on a partition nothing else used. The control sends the same request without a key: it reuses the prefix
the old weights computed and is off by the stale shift.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from sglang_sim.engine import STALE_KV_SHIFT
from support.server import assert_engine_baseline, chat_url, engine_info, metric, new_session
from support.stack import Stack, StackFactory
from trajectory import sample_metadata, samples_from_json

FAMILY = "qwen3"
LONG = 200
CHAT = {"messages": [{"role": "user", "content": f"a shared history of some length [[sim: tokens {LONG}]]"}]}
PACE = 0.5  # seconds a token while the push lands: the push has (LONG - CUT_AFTER) * PACE s, on any machine
CUT_AFTER = 3
RECOMPUTED = 'session_server_turn_continuations_total{result="continued"}'


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--token-latency-ms", "5"], proxied={"server"},
                       servers={"server": [], "bound": ["--max-staleness", "0"],
                                "refuse": ["--max-staleness", "0", "--stale-turns", "refuse"]}) as stack:
        yield stack


def _wait(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def _generate(engine: str, body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """`body` sent straight to the engine under a new rid, with `changes` (a key of None is left out)."""
    sent = {k: v for k, v in {**body, "rid": f"ref-{time.monotonic_ns()}", **changes}.items() if v is not None}
    r = httpx.post(f"{engine}/generate", json=sent, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _logprobs(reply: dict[str, Any]) -> np.ndarray:
    return np.asarray([e[0] for e in reply["meta_info"]["output_token_logprobs"]], np.float64)


def _push_through(server: str, engine: str, path: str, version: str) -> None:
    """A push as a trainer makes it: the server paused in place, the engine's update, the continue naming it."""
    assert httpx.post(f"{server}/admin/pause", json={"mode": "in_place"}).status_code == 200
    try:
        updated = httpx.post(f"{engine}/update_weights_from_disk", json={
            "model_path": path, "weight_version": version, "abort_all_requests": False, "flush_cache": False})
        assert updated.status_code == 200, updated.text
    finally:
        assert httpx.post(f"{server}/admin/continue", json={"weight_version": version}).status_code == 200


def test_a_push_while_a_reply_runs_leaves_every_token_exact_and_the_control_is_not(stack: Stack) -> None:
    server, engine, proxy = stack.server, stack.engine, stack.proxy
    assert proxy is not None
    proxy.clear()
    a, b = new_session(server), new_session(server)
    continued = metric(server, RECOMPUTED, default=0.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert httpx.post(f"{engine}/slow_down", json={"forward_sleep_time": PACE}).status_code == 200
        try:
            chat = pool.submit(httpx.post, chat_url(server, a), json=CHAT, timeout=180)
            _wait(lambda: engine_info(engine)["output_tokens_in_flight"] >= CUT_AFTER, "tokens under the old weights")
            first = proxy.calls[0]["request"]
            assert first["extra_key"] == "weights:default"
            # the control's prime: the same prompt, no key, computed by the old weights (one token, paced)
            primed = _generate(engine, first, extra_key=None, sampling_params={"max_new_tokens": 1})
            assert primed["meta_info"]["finish_reason"]["type"] == "length"
            assert httpx.post(f"{server}/admin/pause", json={"mode": "in_place"}).status_code == 200
            assert engine_info(engine)["running_requests"] == 0  # cut: nothing runs while the weights change
            updated = httpx.post(f"{engine}/update_weights_from_disk", json={
                "model_path": "step-1", "weight_version": "1", "abort_all_requests": False, "flush_cache": False})
            assert updated.status_code == 200, updated.text
            assert httpx.post(f"{server}/admin/continue", json={"weight_version": "1"}).status_code == 200
        finally:
            httpx.post(f"{engine}/slow_down", json={"forward_sleep_time": None})
        reply = chat.result()
    assert reply.status_code == 200, reply.text
    assert metric(server, RECOMPUTED, default=0.0) == continued + 1
    calls = [c for c in proxy.settled() if c["path"] == "/generate"]
    assert len(calls) == 2, [(c["request"]["extra_key"], c["response"]["meta_info"]["finish_reason"]) for c in calls]
    cut, rest = calls
    assert cut["response"]["meta_info"]["finish_reason"]["type"] == "abort"
    # the straddled reply: its old tokens keep their version, the rest is re-prefilled and sampled under the new key
    assert rest["request"]["extra_key"] == "weights:1"
    assert rest["request"]["input_ids"] == first["input_ids"] + cut["response"]["output_ids"]
    assert rest["response"]["meta_info"]["weight_version"] == "1"
    reference = _generate(engine, rest["request"], extra_key="reference:rest")
    np.testing.assert_array_equal(_logprobs(rest["response"]), _logprobs(reference))

    # another session's new turn with the same prompt: keyed by the new weights, exact
    proxy.clear()
    second = httpx.post(chat_url(server, b), json=CHAT, timeout=60)
    assert second.status_code == 200, second.text
    (turn,) = (c for c in proxy.settled() if c["path"] == "/generate")
    assert turn["request"]["extra_key"] == "weights:1"
    reference = _generate(engine, turn["request"], extra_key="reference:turn")
    assert reference["meta_info"]["cached_tokens"] == 0
    np.testing.assert_array_equal(_logprobs(turn["response"]), _logprobs(reference))

    # the control: the same request without a key reuses the prefix the old weights computed, and is off
    control = _generate(engine, turn["request"], extra_key=None)
    assert control["meta_info"]["cached_tokens"] >= len(first["input_ids"]) - 1
    off = _logprobs(control) - _logprobs(reference)
    np.testing.assert_allclose(off, STALE_KV_SHIFT, atol=1e-6)
    for sid in (a, b):
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    httpx.post(f"{engine}/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
    assert_engine_baseline(engine)


@pytest.mark.parametrize("name", ["bound", "refuse"])
def test_a_turn_past_max_staleness_is_sampled_again_from_its_prompt_or_refused(stack: Stack, name: str) -> None:
    """--max-staleness 0: a turn cut by a push is more than 0 versions behind the new weights. regenerate (default):
    it is sampled again from its prompt, so every token of the reply is the new weights'; refuse: a 503 to retry."""
    server, engine = stack.servers[name], stack.engine
    assert httpx.post(f"{server}/admin/continue").status_code == 200  # the server asks the engine what it serves
    sid = new_session(server)
    counted = "regenerated" if name == "bound" else "stale"
    before = metric(server, f'session_server_turn_continuations_total{{result="{counted}"}}', default=0.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert httpx.post(f"{engine}/slow_down", json={"forward_sleep_time": PACE}).status_code == 200
        try:
            chat = pool.submit(httpx.post, chat_url(server, sid), json=CHAT, timeout=180)
            _wait(lambda: engine_info(engine)["output_tokens_in_flight"] >= CUT_AFTER, "tokens under the old weights")
            _push_through(server, engine, "step-7", "7")
        finally:
            httpx.post(f"{engine}/slow_down", json={"forward_sleep_time": None})
        reply = chat.result()
    assert metric(server, f'session_server_turn_continuations_total{{result="{counted}"}}', default=0.0) == before + 1
    if name == "bound":
        assert reply.status_code == 200, reply.text
        sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}).json())[0]
        sampled = np.flatnonzero(sample.loss_mask)
        assert len(sampled) == reply.json()["usage"]["completion_tokens"]
        # sampled again from the prompt: no token of the old weights is left (a continuation would keep them)
        assert {sample_metadata(sample).token_versions[p] for p in sampled.tolist()} == {"7"}
        assert sample.metadata["weight_version_tokens"] == {"7": len(sampled)}
        assert sample.metadata["session_continuations"] == {"continued": 1, "regenerated": 1}  # the session's count
    else:
        assert reply.status_code == 503 and "retry-after" in reply.headers, reply.text
        assert "max-staleness" in reply.text
        # the refusal is the infrastructure's (issue 38 item 4), by its own cause
        (listed,) = [s for s in httpx.get(f"{server}/admin/sessions").json()["sessions"] if s["id"] == sid]
        assert listed["continuations"] == {"continued": 1, "stale": 1}
        assert (listed["failure"]["cause"], listed["failure"]["status"]) == ("stale", 503)
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    httpx.post(f"{engine}/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
    assert httpx.post(f"{server}/admin/continue").status_code == 200
    assert_engine_baseline(engine)


def test_a_key_that_got_kv_of_other_weights_is_never_reused(stack: Stack) -> None:
    """Weights pushed behind the server's back: its next request carries the key of the version it believes, the
    engine computes that request's KV with the weights it really serves and keeps it under that key. The reply names
    those weights, so the server learns them, and once the believed version is served again it is keyed by a fresh
    namespace: a later turn whose prefix is that request's is prefilled anew and exact. The control (the old key)
    reuses the mislabelled prefix and is off by the stale shift. (Seen on the real engine: a teardown that put the
    first weights back made the next in-place push's continuation read 150 tokens of mislabelled KV.)"""
    server, engine, proxy = stack.server, stack.engine, stack.proxy
    assert proxy is not None
    _push_through(server, engine, "step-11", "11")
    behind = httpx.post(f"{engine}/update_weights_from_disk", json={
        "model_path": "step-12", "weight_version": "12", "abort_all_requests": False, "flush_cache": True})
    assert behind.status_code == 200, behind.text
    sid = new_session(server)
    proxy.clear()
    history: list[dict[str, Any]] = [{"role": "user", "content": "first [[sim: tokens 40]]"}]
    first = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=60)
    assert first.status_code == 200, first.text
    sent, redone = (c for c in proxy.settled() if c["path"] == "/generate")
    assert sent["request"]["extra_key"] == "weights:11"  # the belief, wrong
    assert sent["response"]["meta_info"]["weight_version"] == "12"  # what computed its KV
    # a reply of other weights than its key's is not trusted: sampled again under the key of the weights it named
    assert redone["request"]["extra_key"] == "weights:12"

    _push_through(server, engine, "step-11", "11")
    proxy.clear()
    history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "second [[sim: tokens 8]]"}]
    second = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=60)
    assert second.status_code == 200, second.text
    (turn,) = (c for c in proxy.settled() if c["path"] == "/generate")
    assert turn["request"]["extra_key"] == "weights:11#1"
    assert turn["response"]["meta_info"]["cached_tokens"] == 0
    reference = _generate(engine, turn["request"], extra_key="reference:fresh")
    np.testing.assert_array_equal(_logprobs(turn["response"]), _logprobs(reference))
    control = _generate(engine, turn["request"], extra_key="weights:11")
    assert control["meta_info"]["cached_tokens"] >= len(sent["request"]["input_ids"]) - 1
    np.testing.assert_allclose(_logprobs(control) - _logprobs(reference), STALE_KV_SHIFT, atol=1e-6)
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    httpx.post(f"{engine}/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
    assert httpx.post(f"{server}/admin/continue").status_code == 200
    assert_engine_baseline(engine)
