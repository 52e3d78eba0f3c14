"""Issue 34's done-when on released SGLang 0.5.23: a multi-turn episode with several screenshots through each API on
the real engine (the tiny random Qwen3-VL), token-exact, and the trainer's recompute of its logprobs matching.

Each API runs one episode of three screenshots (Chat Completions with `image_url` data URLs, Responses with
`input_image` and `previous_response_id`, Anthropic Messages with base64 `image` blocks; Chat once more streamed)
through a session server of the `qwen3-vl` family in front of the engine, through a recording proxy.
`check_exact` (tests/support/image_episodes.py) holds every turn to what the engine received: `input_ids` are the
stored prompt with each image's run collapsed to one pad, `image_data` every image so far in order, and the engine's
own expansion of that input (asked again with `return_prompt_token_ids`) is exactly the stored prompt. The sample
(safetensors, pixel values computed by the server with transformers' processor) is then scored by
`rollout.check_logprobs` with `Qwen3VLForConditionalGeneration` on the same checkpoint, within the design's 1e-3.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.launchers import start_session_server
from support.image_episodes import check_exact, episode, screenshot
from support.server import RecordingProxy, new_session
from support.sglang_engine import Engines
from trajectory import samples_from_safetensors

REPORT = os.environ.get("IMAGES_REPORT")  # a file to write each episode's image spans and payload size to


@pytest.fixture(scope="module")
def vl(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, RecordingProxy, Path]]:
    engine = engines.get("vl")
    checkpoint = engines.checkpoint("qwen3-vl")
    proxy = RecordingProxy(engine.url)
    # A long request timeout: the engine's first image request warms its processor up (90 s seen under load).
    proc = start_session_server(proxy.url, checkpoint, "qwen3-vl", "--request-timeout", "900",
                                log_dir=tmp_path_factory.mktemp("served"))
    try:
        yield proc.url, engine.url, proxy, checkpoint
    finally:
        try:
            proc.close()
        finally:
            proxy.close()
            engines.stop("vl")  # its ~3.7 GB back before the next module's engine starts


@pytest.fixture(scope="module")
def policy(vl: tuple[str, str, RecordingProxy, Path]) -> Any:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(vl[3], dtype=torch.float32).eval()


@pytest.mark.parametrize(("api", "stream"), [("chat", False), ("responses", False), ("messages", False),
                                             ("chat", True)], ids=["chat", "responses", "messages", "chat-streamed"])
def test_an_image_episode_is_exact_and_recomputes(vl: tuple[str, str, RecordingProxy, Path], policy: Any,
                                                   api: str, stream: bool) -> None:
    from rollout.logprob_check import check_logprobs

    server, engine, proxy, _ = vl
    sid = new_session(server)
    images = [screenshot(i) for i in range(3)]
    asyncio.run(episode(api, f"{server}/sessions/{sid}/v1", images, stream, directive=False, max_tokens=6))
    calls = [c for c in proxy.settled() if c["path"] == "/generate" and c["routing_key"] == sid]
    report = check_exact(server, engine, calls, sid, images)
    payload = httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=300,
                         headers={"accept": "application/octet-stream"}).content
    (sample,) = samples_from_safetensors(payload)
    if REPORT:
        Path(f"{REPORT}.{api}{'-streamed' if stream else ''}.safetensors").write_bytes(payload)
    # The requests left temperature at SGLang's default (1.0): the logprobs are those of softmax(logits / 1).
    check = check_logprobs([sample], policy, temperature=1.0)
    worst = check.metrics["rollout_check/logprob_abs_diff_max"]
    if REPORT:
        with open(REPORT, "a") as out:
            out.write(json.dumps({"api": api, "stream": stream, **report, "logprob_abs_diff_max": worst,
                                  "sampled_tokens": int(sample.loss_mask.sum())}) + "\n")
    assert worst <= 1e-3, check.worst
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=60).status_code == 204
