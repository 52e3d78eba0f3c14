"""sglang-sim over real HTTP with `image_data`: the rules SGLang 0.5.23 follows for a Qwen3-VL checkpoint.

The checks are tests/support/images.py's, which tests/sglang/test_real_images_wire.py runs on the real engine: one
`<|image_pad|>` per image goes in, the expanded prompt comes back (`return_prompt_token_ids`), more pads than images is
SGLang's 500, and the radix cache tells images apart by content.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from harness.launchers import start_sim
from support.images import CHECKS, IMG, RED, Encode, data_url, generate, png, user_turn
from support.sim import assert_baseline


@pytest.fixture(scope="module")
def sim(tokenizer_dirs, hf_tokenizers, tmp_path_factory):
    # The Qwen3 tokenizer directory has no preprocessor_config.json: the sim resizes as the published Qwen3-VL does.
    args = ("--context-length", "4096", "--kv-capacity-tokens", "20000", "--token-latency-ms", "5")
    with start_sim(tokenizer_dirs["qwen3"], "qwen3", *args, log_dir=tmp_path_factory.mktemp("sim")) as proc, \
            httpx.Client(base_url=proc.url, timeout=60) as client:
        yield client, hf_tokenizers["qwen3"]
        assert_baseline(client)


@pytest.fixture
def client(sim):
    client, _ = sim
    assert client.post("/flush_cache").status_code == 200
    yield client
    assert_baseline(client)


@pytest.fixture
def encode(sim) -> Encode:
    _, tok = sim
    return lambda text: list(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_image_wire_fact(client: httpx.Client, encode: Encode, check: Callable[[httpx.Client, Encode], None]) -> None:
    check(client, encode)


def test_another_image_gets_another_reply(client: httpx.Client, encode: Encode) -> None:
    """The sim seeds its reply from the prompt as its cache keys it, images included: a reply depends on the image."""
    prompt = encode(user_turn(f"{IMG}What is this?"))
    first = generate(client, prompt, data_url(RED)).json()
    assert generate(client, prompt, data_url(RED)).json()["output_ids"] == first["output_ids"]
    assert generate(client, prompt, data_url(png(320, 240, (0, 0, 255)))).json()["output_ids"] != first["output_ids"]


def test_images_on_engine_sessions_are_refused_plainly(client: httpx.Client, encode: Encode) -> None:
    """Not emulated (real SGLang takes them): a clear 400 rather than a silently wrong prompt."""
    session = client.post("/open_session", json={"capacity_of_str_len": 10000}).json()
    try:
        r = generate(client, encode(user_turn(f"{IMG}x")), data_url(RED), session_params={"id": session})
        assert r.status_code == 400 and "does not emulate image_data on engine sessions" in r.text
    finally:
        assert client.post("/close_session", json={"session_id": session}).status_code == 200
