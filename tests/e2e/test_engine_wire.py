"""The engine wire as released SGLang 0.5.23 speaks it (issue 9 points 1, 2, 5, 7), server and sim together.

Each sim shape is pinned to the SGLang source it copies (named per test); a recording proxy shows the bodies the
server sent and the engine's answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import chat_url, metric, new_session, wait_engine_idle
from support.stack import Stack, StackFactory

FAMILY = "qwen3"


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--token-latency-ms", "2"], proxied={"server"}) as stack:
        yield stack


def _records(server: str, sid: str) -> list[dict[str, Any]]:
    return httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["records"]


def test_no_max_tokens_sends_null_and_is_not_cut_at_128(stack: Stack) -> None:
    """sampling_params.py: max_new_tokens defaults to 128 when left out; null is "up to the context"
    (scheduler.py init_req_max_new_tokens). serving_chat.py sends null when the client gives no limit."""
    assert stack.proxy is not None
    stack.proxy.clear()
    sid = new_session(stack.server)
    r = httpx.post(chat_url(stack.server, sid), json={"messages": [{"role": "user", "content": "[[sim: tokens 300]]"}]},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = stack.proxy.generates()[-1]["request"]
    assert "max_new_tokens" in body["sampling_params"] and body["sampling_params"]["max_new_tokens"] is None
    assert r.json()["usage"]["completion_tokens"] > 128 and r.json()["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(chat_url(stack.server, new_session(stack.server)),
                   json={"messages": [{"role": "user", "content": "[[sim: tokens 300]]"}], "max_tokens": 7})
    assert stack.proxy.generates()[-1]["request"]["sampling_params"]["max_new_tokens"] == 7
    assert r.json()["usage"]["completion_tokens"] == 7


def test_sim_null_max_new_tokens_and_absent_default(stack: Stack) -> None:
    prompt = "[[sim: tokens 300]]"
    long = httpx.post(f"{stack.engine}/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": None}},
                      timeout=60).json()
    assert long["meta_info"]["finish_reason"]["type"] == "stop" and long["meta_info"]["completion_tokens"] > 300
    short = httpx.post(f"{stack.engine}/generate", json={"text": prompt, "sampling_params": {}}, timeout=60).json()
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert short["meta_info"]["completion_tokens"] == 128


def test_queued_abort_is_continued_once_the_engine_continues(stack: Stack) -> None:
    """A request aborted in the engine's waiting queue (pause_generation mode abort, abort_all, a weight update)
    comes back 200 with the reduced meta_info of tokenizer_manager.py `_handle_abort_req`: nothing was sampled, so
    the turn's continuation is the same request again (turns/resume.py), which waits in the paused engine and runs
    once it continues."""
    server, engine = stack.server, stack.engine
    sid = new_session(server)
    continued = 'session_server_turn_continuations_total{result="continued"}'
    before = metric(server, continued, default=0.0)
    assert stack.proxy is not None
    stack.proxy.clear()
    assert httpx.post(f"{engine}/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        with httpx.Client(timeout=30) as http:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(http.post, chat_url(server, sid),
                                  json={"messages": [{"role": "user", "content": "queued"}]})
                deadline = time.monotonic() + 60  # only a hang fails: the engine is paused, nothing races
                while httpx.get(f"{engine}/server_info").json()["waiting_requests"] < 1:
                    assert time.monotonic() < deadline, "the chat never reached the engine's queue"
                    time.sleep(0.01)
                assert httpx.post(f"{engine}/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
                while not (metric(server, continued, default=0.0) == before + 1
                           and httpx.get(f"{engine}/server_info").json()["waiting_requests"] == 1):
                    assert time.monotonic() < deadline, "the continuation never reached the engine's queue"
                    time.sleep(0.01)
                assert not fut.done()
                assert httpx.post(f"{engine}/continue_generation", json={}).status_code == 200
                r = fut.result()
    finally:
        assert httpx.post(f"{engine}/continue_generation", json={}).status_code == 200
    assert r.status_code == 200, r.text
    assert len(_records(server, sid)) == 1
    # the /generate calls: after an abort of everything the server also asks the engine's weights (/model_info)
    aborted, resent = [c for c in stack.proxy.settled() if c["path"] == "/generate"][-2:]
    meta = aborted["response"]["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta and "cached_tokens" not in meta
    assert aborted["response"]["output_ids"] == [] and aborted["response"]["text"] == ""
    assert meta["completion_tokens"] == 0
    assert resent["request"]["input_ids"] == aborted["request"]["input_ids"]
    assert resent["request"]["rid"] != aborted["request"]["rid"]
    wait_engine_idle(engine)


def test_nan_happened_is_a_502_counted_by_rule(stack: Stack) -> None:
    """schedule_batch.py Req._check_vocab_boundary_finish: a NaN sample ends the request with
    {"type": "stop", "matched": "NaN happened"}; those tokens are not the policy's."""
    server = stack.server
    sid = new_session(server)
    before = metric(server, 'session_server_engine_validation_failures_total{rule="nan_happened"}', default=0.0)
    assert httpx.post(f"{stack.engine}/sim/faults", json={"nan_happened": 1.0}).status_code == 200
    try:
        r = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    finally:
        httpx.post(f"{stack.engine}/sim/faults", json={})
    assert r.status_code == 502 and "NaN happened" in r.text
    assert _records(server, sid) == []
    assert metric(server, 'session_server_engine_validation_failures_total{rule="nan_happened"}') == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_value_the_engine_refuses_passes_through_as_its_400(stack: Stack, stream: bool) -> None:
    """http_server.py: a value SGLang's tokenizer manager refuses is a 400 for a plain request and, for a streamed
    one, HTTP 200 with an `{"error": ...}` event and `[DONE]` (the sim's `value_error` fault answers both forms).
    Either way the agent gets the engine's 400 and its message, before any byte of a reply, and nothing is recorded."""
    server = stack.server
    sid = new_session(server)
    assert stack.proxy is not None
    stack.proxy.clear()
    assert httpx.post(f"{stack.engine}/sim/faults", json={"value_error": 1.0}).status_code == 200
    try:
        r = httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi"}], "stream": stream},
                       timeout=30)
    finally:
        httpx.post(f"{stack.engine}/sim/faults", json={})
    (call,) = stack.proxy.settled()
    assert call["status"] == (200 if stream else 400)  # the engine's own form of the refusal
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert error["message"] == "sglang-sim injected fault: value_error"
    if stream:
        assert error == {"message": "sglang-sim injected fault: value_error", "type": "invalid_request_error",
                         "code": 400, "retryable": False}
    assert _records(server, sid) == []
    assert httpx.post(chat_url(server, sid), json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=30).status_code == 200
    wait_engine_idle(stack.engine)
