"""sglang-sim's `/slow_down`, SGLang's own test hook for pacing an engine: `forward_sleep_time` seconds before every
decode step from the next step on, on top of `--token-latency-ms`, lifted by null or a value <= 0.

The tests of both tiers use it (support/sglang_engine.py `paced`) to make a reply long by construction. Every bound
here is a lower bound that sleeping guarantees, or separates a paced reply from an unpaced one by orders of magnitude.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.launchers import start_sim
from support.sim import assert_baseline, chat_ids, wait_for

FAMILY = "qwen3"
TOKENS = 40  # the reply's length: `[[sim: tokens N]]` makes the sim generate up to the limit


@pytest.fixture(scope="module")
def client(tokenizer_dirs: dict[str, str]) -> Iterator[httpx.Client]:
    with start_sim(tokenizer_dirs[FAMILY], FAMILY) as proc, httpx.Client(base_url=proc.url, timeout=600) as c:
        yield c
        assert_baseline(c)


@pytest.fixture
def prompt(hf_tokenizers: dict[str, object]) -> list[int]:
    return chat_ids(hf_tokenizers[FAMILY], [{"role": "user", "content": "Go on. [[sim: tokens 5000]]"}])


def _generate(client: httpx.Client, prompt: list[int], rid: str) -> httpx.Response:
    return client.post("/generate", json={"input_ids": prompt, "rid": rid,
                                          "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0}})


def _slow_down(client: httpx.Client, seconds: float | None) -> None:
    r = client.post("/slow_down", json={"forward_sleep_time": seconds})
    assert r.status_code == 200 and r.json() is None, r.text


def test_a_pace_makes_every_step_last_at_least_that_long(client: httpx.Client, prompt: list[int]) -> None:
    pace = 0.05
    _slow_down(client, pace)
    try:
        started = time.monotonic()
        r = _generate(client, prompt, "paced")
        elapsed = time.monotonic() - started
    finally:
        _slow_down(client, 0)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == TOKENS
    assert elapsed >= TOKENS * pace


@pytest.mark.parametrize("lift", [0, None, -1])
def test_a_lifted_pace_is_gone(client: httpx.Client, prompt: list[int], lift: float | None) -> None:
    """Paced at an hour per step, then lifted: the reply comes at once (hours apart from a paced one)."""
    _slow_down(client, 3600.0)
    _slow_down(client, lift)
    started = time.monotonic()
    r = _generate(client, prompt, f"lifted-{lift}")
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == TOKENS
    assert time.monotonic() - started < 600


def test_a_pace_set_mid_reply_applies_from_the_next_step(client: httpx.Client, prompt: list[int]) -> None:
    """A reply under way at full speed is slowed to an hour per step: it is still running long after it would have
    ended, and an abort by its rid ends it at once (a step's sleep does not hold an abort back)."""
    first = 0.1  # the reply takes TOKENS * first = 4 s at this pace: still under way when the long pace lands
    _slow_down(client, first)
    replies: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: replies.append(_generate(client, prompt, "mid-reply")))
    worker.start()
    try:
        wait_for(lambda: client.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 1)
        _slow_down(client, 3600.0)
        time.sleep(TOKENS * first + 1)  # past the reply's end at the first pace
        assert client.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 1
        assert client.post("/abort_request", json={"rid": "mid-reply"}).status_code == 200
        worker.join(600)
    finally:
        _slow_down(client, 0)
    (r,) = replies
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < TOKENS


@pytest.mark.parametrize("body", [{}, {"forward_sleep_time": "x"}, [1], "null"])
def test_a_malformed_body_is_a_400_and_changes_nothing(client: httpx.Client, body: object) -> None:
    r = client.post("/slow_down", json=body)
    assert r.status_code == 400 and r.json()["object"] == "error", r.text
