"""The benchmarks' floor (benchmarks/floor_proxy.py) relays real chats to a real engine: plain and streamed replies
carry the engine's text, so the CPU it is measured at is the cost of a real relay, not of an error path."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from benchmarks.benchlib import start_floor
from harness.launchers import start_sim
from sglang_sim import directives


@pytest.fixture(scope="module", params=[False, True], ids=["cumulative", "deltas"])
def stack(request, tokenizer_dirs):
    deltas = request.param
    sim_args = ["--incremental-streaming-output"] if deltas else []
    with start_sim(tokenizer_dirs["qwen3"], "qwen3", *sim_args) as sim:
        floor = start_floor(sim.url, *(["--engine-incremental-streaming"] if deltas else []), cpu=None, log_dir=None)
        try:
            with (httpx.Client(base_url=floor.url, timeout=30) as client,
                  httpx.Client(base_url=sim.url, timeout=30) as engine):
                yield client, engine
        finally:
            floor.stop()


def _body(stream: bool) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"hello {directives.tokens(40)}"}], "max_tokens": 80,
            "stream": stream}


def test_plain_and_streamed_replies_carry_the_engine_text(stack):
    client, engine = stack
    sid = client.post("/sessions", json={}).json()["session_id"]
    plain = client.post(f"/sessions/{sid}/v1/chat/completions", json=_body(False))
    assert plain.status_code == 200
    reply = plain.json()
    text = reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] >= 40 and text
    direct = engine.post("/generate", json={"text": "hello " + directives.tokens(40),
                                            "sampling_params": {"max_new_tokens": 80}}).json()
    assert direct["text"] == text  # the engine's own reply to the same text

    streamed = ""
    with client.stream("POST", f"/sessions/{sid}/v1/chat/completions", json=_body(True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += msgspec.json.decode(line[6:])["choices"][0]["delta"]["content"]
    assert streamed == text
    assert client.delete(f"/sessions/{sid}").status_code == 204
