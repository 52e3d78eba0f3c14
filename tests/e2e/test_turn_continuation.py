"""A turn whose engine request the engine aborts for everyone (a weight update) goes on: the agent gets one reply.

Against the sim (which aborts on `/update_weight_version` and `/pause_generation` mode `abort` as SGLang does, and
continues a cut reply as a model continues its own text), through a recording proxy: the continuation's input is
the first request's input + the tokens it sampled, the sample is prompt + every sampled token with the engine's
logprobs and each token's weight version, and the reply is the one an uninterrupted run gives. Plain and streamed,
several continuations, the bound, a DELETE while the continuation waits in a paused engine. Every wait is for an
event (tokens emitted, a metric), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from sglang_sim.engine import weight_shift
from support.server import assert_engine_baseline, chat_url, engine_info, metric, new_session, sse_events
from support.stack import Stack, StackFactory
from trajectory import sample_metadata, samples_from_json

FAMILY = "qwen3"
TOKEN_MS = 10
LONG = 200  # tokens: 2 s at the engine, unpaced
CHAT = {"messages": [{"role": "user", "content": f"go on [[sim: tokens {LONG}]]"}]}
# While a test cuts a reply, the engine is paced (SGLang's /slow_down) at PACE seconds a token and the cut comes after
# CUT_AFTER tokens: the call that cuts has (LONG - CUT_AFTER) * PACE = 98 s to land, on any machine.
PACE = 0.5
CUT_AFTER = 3
LONG_TWICE = 500
CHAT_TWICE = {"messages": [{"role": "user", "content": f"go on and on [[sim: tokens {LONG_TWICE}]]"}]}
CONTINUED = 'session_server_turn_continuations_total{result="continued"}'


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY, sim_args=["--token-latency-ms", str(TOKEN_MS), "--enable-streaming-session"],
        proxied={"server", "bounded", "sessions"},
        servers={"server": [], "bounded": ["--max-turn-continuations", "1"],
                 "never": ["--max-turn-continuations", "0"], "sessions": ["--engine-sessions"]},
    ) as stack:
        yield stack


@pytest.fixture
def versions(stack: Stack) -> Iterator[None]:
    yield
    httpx.post(f"{stack.engine}/continue_generation", json={}, timeout=10)
    httpx.post(f"{stack.engine}/update_weight_version", json={"new_version": "default", "abort_all_requests": False},
               timeout=10)
    for server in stack.servers.values():  # a continue asks the engine which weights it serves (engine/versions.py)
        assert httpx.post(f"{server}/admin/continue", timeout=10).status_code == 200


def _wait(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


@contextlib.contextmanager
def _paced(engine: str) -> Iterator[None]:
    """Hold the engine at PACE seconds a token (its requests, and their continuations, stay running) and lift it on
    the way out, also on failure."""
    r = httpx.post(f"{engine}/slow_down", json={"forward_sleep_time": PACE}, timeout=10)
    assert r.status_code == 200, r.text
    try:
        yield
    finally:
        httpx.post(f"{engine}/slow_down", json={"forward_sleep_time": None}, timeout=10)


def _emitted(engine: str, at_least: int) -> None:
    """Wait until the engine's live request has emitted `at_least` tokens."""
    _wait(lambda: engine_info(engine)["output_tokens_in_flight"] >= at_least, f"{at_least} tokens emitted")


def _update(engine: str, version: str, route: str = "update_weight_version") -> None:
    """What a trainer does: a new weight version (SGLang's default: every in-flight request aborted), or new weights
    from disk with `abort_all_requests`."""
    body = {"new_version": version} if route == "update_weight_version" else {
        "model_path": "step", "weight_version": version, "abort_all_requests": True, "flush_cache": False}
    r = httpx.post(f"{engine}/{route}", json=body, timeout=10)
    assert r.status_code == 200, r.text


def _continued(server: str) -> float:
    return metric(server, CONTINUED, default=0.0)


def _cut(stack: Stack, server: str, versions: list[str], body: dict[str, Any],
         route: str = "update_weight_version", masks: bool = False) -> httpx.Response:
    """Post `body` to a new session of `server` (`masks`: one that records sampling masks) and, while it runs, cut
    it with one weight update per version (each after the running request emitted some tokens); the chat's
    response."""
    sid = new_session(server) if not masks else httpx.post(
        f"{server}/sessions", json={"return_sampling_masks": True}, timeout=10).json()["session_id"]
    base = _continued(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _paced(stack.engine):
            fut = pool.submit(httpx.post, chat_url(server, sid), json=body, timeout=120)
            for i, version in enumerate(versions):
                _emitted(stack.engine, CUT_AFTER)
                _update(stack.engine, version, route)
                if i + 1 < len(versions):  # the next cut is for the continuation, once it runs
                    _wait(lambda n=i: _continued(server) >= base + n + 1 or fut.done(), "the turn continued")
        resp = fut.result()
    resp.extensions["sid"] = sid
    return resp


def _sample(server: str, sid: str) -> Any:
    return samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=10).json())[0]


def _uninterrupted(stack: Stack, body: dict[str, Any]) -> tuple[httpx.Response, Any]:
    sid = new_session(stack.server)
    resp = httpx.post(chat_url(stack.server, sid), json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    sample = _sample(stack.server, sid)
    assert httpx.delete(f"{stack.server}/sessions/{sid}").status_code == 204
    return resp, sample


def _token_versions(reply: dict[str, Any]) -> list[str]:
    """The weight version of each token of an engine reply, from its meta_info (per-token spans when the version
    changed while it ran, else the one version)."""
    meta = reply["meta_info"]
    if meta.get("weight_versions"):
        return [span["version"] for span in meta["weight_versions"] for _ in range(span["end"] - span["start"])]
    return [meta["weight_version"]] * len(reply["output_ids"])


def _span_versions(spans: list[list[Any]], start: int, count: int) -> list[str]:
    """The sample's `weight_version_spans` as one version per sampled token (they must cover exactly those)."""
    versions = [version for version, a, b in spans for _ in range(a, b)]
    assert [a for _, a, _ in spans][:1] == [start] and all(
        b == a2 for (_, _, b), (_, a2, _) in itertools.pairwise(spans)), spans
    assert len(versions) == count, spans
    return versions


@pytest.mark.parametrize("route", ["update_weight_version", "update_weights_from_disk"])
def test_a_weight_update_mid_reply_is_continued_exactly(stack: Stack, versions: None, route: str) -> None:
    server = stack.server
    assert stack.proxy is not None
    stack.proxy.clear()
    before = _continued(server)
    resp = _cut(stack, server, ["step-2"], CHAT, route)
    assert resp.status_code == 200, resp.text
    sid = resp.extensions["sid"]
    assert _continued(server) == before + 1
    first, second = (call for call in stack.proxy.settled() if call["path"] == "/generate")
    cut = first["response"]
    assert cut["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(cut["output_ids"]) < LONG
    # TITO: the continuation is the first input + every token sampled before the cut, with the budget reduced
    assert second["request"]["input_ids"] == first["request"]["input_ids"] + cut["output_ids"]
    assert second["request"]["rid"] != first["request"]["rid"]
    assert second["request"]["sampling_params"] == first["request"]["sampling_params"]  # null budget stays null
    rest = second["response"]
    sampled = cut["output_ids"] + rest["output_ids"]
    sample = _sample(server, sid)
    prompt = first["request"]["input_ids"]
    assert sample.tokens.tolist() == prompt + sampled
    assert sample.loss_mask.tolist() == [0] * len(prompt) + [1] * len(sampled)
    entries = cut["meta_info"]["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]
    engine_logprobs = [e[0] for e in entries]
    np.testing.assert_array_equal(sample.rollout_log_probs[len(prompt):], np.asarray(engine_logprobs, np.float32))
    # each sampled token under the weights the engine says sampled it (a token the cut request emitted between the
    # version change and its abort is the new version's), the spans over the sample's positions
    engine_versions = _token_versions(cut) + _token_versions(rest)
    assert engine_versions[0] == "default" and engine_versions[-1] == "step-2"
    assert _span_versions(sample.metadata["weight_version_spans"], len(prompt), len(sampled)) == engine_versions
    # the agent's reply is the one an uninterrupted run gives (the sim continues its own text)
    whole, whole_sample = _uninterrupted(stack, CHAT)
    assert resp.json()["choices"][0]["message"] == whole.json()["choices"][0]["message"]
    usage, whole_usage = resp.json()["usage"], whole.json()["usage"]  # cached tokens differ: the cache is warm now
    assert [usage[k] for k in ("prompt_tokens", "completion_tokens")] == [
        whole_usage[k] for k in ("prompt_tokens", "completion_tokens")]
    assert sample.tokens.tolist() == whole_sample.tokens.tolist()
    # each token's logprob is the uninterrupted run's under the weights that sampled it (the sim's logprobs move with
    # the weights, sglang_sim.engine.weight_shift; a token sampled on KV of other weights would be off by more)
    whole_shift = weight_shift(sample_metadata(whole_sample).token_versions[len(prompt)] or "default")
    shifts = np.asarray([0.0] * len(prompt) + [weight_shift(v) - whole_shift for v in engine_versions], np.float32)
    np.testing.assert_allclose(sample.rollout_log_probs, whole_sample.rollout_log_probs + shifts, atol=1e-6)
    record = httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"][0]
    assert record["finish_reason"]["type"] == "stop" and record["completion_len"] == len(sampled)
    assert record["rid"] == first["request"]["rid"] and record["prompt_tokens"] == len(prompt)
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack.engine)


def test_a_streamed_reply_simply_goes_on(stack: Stack, versions: None) -> None:
    server = stack.server
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    resp = _cut(stack, server, ["step-2"], body)
    assert resp.status_code == 200, resp.text
    events = sse_events(resp.content)
    assert resp.content.rstrip().endswith(b"data: [DONE]") and resp.content.count(b"[DONE]") == 1
    assert not any("error" in e for e in events)
    content = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", ()))
    logprobs = [x["logprob"] for e in events for c in e.get("choices", ()) for x in
                ((c.get("logprobs") or {}).get("content") or ())]
    finish = [c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
    whole, whole_sample = _uninterrupted(stack, CHAT)
    assert content == whole.json()["choices"][0]["message"]["content"] and finish == ["stop"]
    sample = _sample(server, resp.extensions["sid"])
    assert sample.tokens.tolist() == whole_sample.tokens.tolist()
    n_prompt = len(sample.tokens) - sample.response_length
    np.testing.assert_array_equal(np.asarray(logprobs, np.float32), sample.rollout_log_probs[n_prompt:])
    assert [v for v, _, _ in sample.metadata["weight_version_spans"]] == ["default", "step-2"]
    assert httpx.delete(f"{server}/sessions/{resp.extensions['sid']}").status_code == 204
    assert_engine_baseline(stack.engine)


@pytest.mark.parametrize("stream", [False, True])
def test_a_continued_reply_keeps_one_sampling_mask_row_per_token(stack: Stack, versions: None, stream: bool) -> None:
    """Sampling masks across two continuations: one row per sampled token, each holding its token, the rows the
    engine sent for the pieces in order (plain: read off the recording proxy)."""
    server = stack.server
    assert stack.proxy is not None
    stack.proxy.clear()
    body = {**CHAT_TWICE, "stream": stream, "temperature": 1.0, "top_p": 0.9, "top_k": 20}
    resp = _cut(stack, server, ["step-2", "step-3"], body, masks=True)
    assert resp.status_code == 200, resp.text
    sample = _sample(server, resp.extensions["sid"])
    masks = sample.sampling_masks
    assert masks is not None and sample.metadata["num_turns"] == 1
    prompt = len(sample.tokens) - sample.response_length
    rows = [masks.row(p).tolist() for p in range(len(sample.tokens))]
    assert rows[:prompt] == [[]] * prompt and all(
        sample.tokens[p] in rows[p] and len(rows[p]) <= 20 for p in range(prompt, len(sample.tokens)))
    if not stream:
        pieces = [c["response"] for c in stack.proxy.settled() if c["path"] == "/generate"]
        assert len(pieces) == 3 and all(c["request"]["return_sampling_mask"] for c in stack.proxy.settled()
                                        if c["path"] == "/generate")
        assert rows[prompt:] == [row for piece in pieces for row in piece["meta_info"]["output_token_sampling_mask"]]
    assert httpx.delete(f"{server}/sessions/{resp.extensions['sid']}").status_code == 204
    assert_engine_baseline(stack.engine)


@pytest.mark.parametrize("stream", [False, True])
def test_several_continuations_keep_every_weight_version(stack: Stack, versions: None, stream: bool) -> None:
    server = stack.server
    before = _continued(server)
    resp = _cut(stack, server, ["step-2", "step-3"], {**CHAT_TWICE, "stream": stream})
    assert resp.status_code == 200, resp.text
    assert _continued(server) == before + 2
    sample = _sample(server, resp.extensions["sid"])
    spans = sample.metadata["weight_version_spans"]
    assert [v for v, _, _ in spans] == ["default", "step-2", "step-3"], spans
    assert spans[0][1] == len(sample.tokens) - sample.response_length and spans[-1][2] == len(sample.tokens)
    assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))
    _, whole_sample = _uninterrupted(stack, CHAT_TWICE)
    assert sample.tokens.tolist() == whole_sample.tokens.tolist()
    assert httpx.delete(f"{server}/sessions/{resp.extensions['sid']}").status_code == 204
    assert_engine_baseline(stack.engine)


@pytest.mark.parametrize("stream", [False, True])
def test_past_the_bound_the_turn_is_a_503_and_commits_nothing(stack: Stack, versions: None, stream: bool) -> None:
    server = stack["bounded"]
    limit = metric(server, 'session_server_turn_continuations_total{result="limit"}', default=0.0)
    resp = _cut(stack, server, ["step-2", "step-3"], {**CHAT_TWICE, "stream": stream})
    sid = resp.extensions["sid"]
    if stream:  # the reply had begun: it ends with an error event
        assert resp.status_code == 200
        assert sse_events(resp.content)[-1]["error"]["code"] == "engine_aborted"
    else:
        assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
    assert metric(server, 'session_server_turn_continuations_total{result="limit"}') == limit + 1
    assert httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"] == []
    again = httpx.post(chat_url(server, sid), json=CHAT_TWICE, timeout=60)  # the same turn, retried
    assert again.status_code == 200, again.text
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack.engine)


def test_zero_continuations_keeps_the_old_503(stack: Stack, versions: None) -> None:
    server = stack["never"]
    resp = _cut(stack, server, ["step-2"], CHAT)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_aborted", resp.text
    assert httpx.get(f"{server}/sessions/{resp.extensions['sid']}", timeout=10).json()["records"] == []
    assert httpx.delete(f"{server}/sessions/{resp.extensions['sid']}").status_code == 204


def test_an_engine_pause_abort_is_continued_after_the_engine_continues(stack: Stack, versions: None) -> None:
    """A trainer pausing the engine itself (mode abort): the continuation waits in the engine's queue, and the turn
    completes once the engine continues."""
    server, engine = stack.server, stack.engine
    sid = new_session(server)
    before = _continued(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _paced(engine):
            fut = pool.submit(httpx.post, chat_url(server, sid), json=CHAT, timeout=120)
            _emitted(engine, CUT_AFTER)
            assert httpx.post(f"{engine}/pause_generation", json={"mode": "abort"}, timeout=10).status_code == 200
        _wait(lambda: _continued(server) == before + 1 and engine_info(engine)["waiting_requests"] == 1,
              "the continuation queued in the paused engine")
        assert not fut.done()
        assert httpx.post(f"{engine}/continue_generation", json={}, timeout=10).status_code == 200
        resp = fut.result()
    assert resp.status_code == 200, resp.text
    _, whole_sample = _uninterrupted(stack, CHAT)
    assert _sample(server, sid).tokens.tolist() == whole_sample.tokens.tolist()
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


@pytest.mark.parametrize("stream", [False, True])
def test_delete_while_the_continuation_waits(stack: Stack, versions: None, stream: bool) -> None:
    """DELETE while the continuation waits in a paused engine: the chat ends, the queued request is aborted by its
    rid, nothing is committed, the engine is left clean."""
    server, engine = stack.server, stack.engine
    sid = new_session(server)
    before = _continued(server)

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            with _paced(engine):
                chat = asyncio.ensure_future(http.post(chat_url(server, sid), json={**CHAT, "stream": stream}))
                await asyncio.to_thread(_emitted, engine, CUT_AFTER)
                assert (await http.post(f"{engine}/pause_generation", json={"mode": "abort"})).status_code == 200
            await asyncio.to_thread(_wait, lambda: _continued(server) == before + 1
                                    and engine_info(engine)["waiting_requests"] == 1, "the continuation queued")
            assert (await http.delete(f"{server}/sessions/{sid}")).status_code == 204
            return await chat

    resp = asyncio.run(main())
    if stream:
        assert resp.status_code == 200, resp.text
        assert sse_events(resp.content)[-1]["error"]["code"] == "session_not_found", resp.text
    else:
        assert resp.status_code == 404, resp.text
    _wait(lambda: engine_info(engine)["waiting_requests"] == 0, "the queued continuation aborted")
    assert httpx.post(f"{engine}/continue_generation", json={}, timeout=10).status_code == 200
    assert httpx.get(f"{server}/sessions/{sid}", timeout=10).status_code == 404
    assert_engine_baseline(engine)


def test_a_continuation_in_an_engine_session_reopens_it_under_the_new_weights(stack: Stack, versions: None) -> None:
    """--engine-sessions: the third turn's engine request carries only its new tokens (the second opened the engine
    session); cut by a weight update, its continuation goes to a fresh SGLang streaming session with the whole prompt
    + the tokens sampled, keyed by the new weights: the old session's KV is the old weights' (issue 38)."""
    server, engine = stack["sessions"], stack.engine
    assert stack.proxy is not None
    sid = new_session(server)
    history: list[dict[str, Any]] = []
    for text in ("first", "second"):
        history.append({"role": "user", "content": f"{text} [[sim: tokens 3]]"})
        reply = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=60)
        assert reply.status_code == 200, reply.text
        history.append(reply.json()["choices"][0]["message"])
    history.append({"role": "user", "content": f"third [[sim: tokens {LONG}]]"})
    stack.proxy.clear()
    before = _continued(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _paced(engine):
            fut = pool.submit(httpx.post, chat_url(server, sid), json={"messages": history}, timeout=120)
            _emitted(engine, CUT_AFTER)
            _update(engine, "step-2")
        resp = fut.result()
    assert resp.status_code == 200, resp.text
    assert _continued(server) == before + 1
    cut, rest = (call for call in stack.proxy.settled() if call["path"] == "/generate")
    assert cut["request"]["session_params"] != rest["request"]["session_params"]  # a fresh engine session
    assert (cut["request"]["extra_key"], rest["request"]["extra_key"]) == ("weights:default", "weights:step-2")
    sample = _sample(server, sid)
    prompt = sample.tokens.tolist()[: len(sample.tokens) - len(cut["response"]["output_ids"])
                                    - len(rest["response"]["output_ids"])]
    assert cut["request"]["input_ids"] == prompt[-len(cut["request"]["input_ids"]):] != prompt  # only the new tokens
    assert rest["request"]["input_ids"] == prompt + cut["response"]["output_ids"]  # all of it
    sampled = cut["response"]["output_ids"] + rest["response"]["output_ids"]
    assert sample.tokens.tolist()[-len(sampled):] == sampled
    assert sample.loss_mask.tolist()[-len(sampled):] == [1] * len(sampled)
    spans = sample.metadata["weight_version_spans"]  # per turn: the first two turns', then the cut one's two
    assert [v for v, _, _ in spans] == ["default", "default", "default", "step-2"], spans
    engine_versions = _token_versions(cut["response"]) + _token_versions(rest["response"])  # as in the test above
    assert _span_versions(spans[2:], len(sample.tokens) - len(sampled), len(sampled)) == engine_versions
    fourth = [*history, resp.json()["choices"][0]["message"], {"role": "user", "content": "fourth [[sim: tokens 3]]"}]
    assert httpx.post(chat_url(server, sid), json={"messages": fourth}, timeout=60).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)
