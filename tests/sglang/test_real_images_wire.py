"""Images on released SGLang 0.5.23: the tiny random Qwen3-VL (scripts/build_tiny_checkpoints.py `qwen3-vl`, served
with `--mm-attention-backend sdpa`) and the wire facts the session server builds on (issue 34).

What is pinned (tests/support/images.py has each check; tests/e2e/test_sim_images.py runs the same on sglang-sim):
- one `<|image_pad|>` per image in `input_ids` plus `image_data` (a data URL or bare base64, one or a list): SGLang
  expands each pad to `t*h*w / 4` pads of the image's grid (trajectory/image_grid.py: a 320x240 PNG is 16x20 patches,
  80 pads), `return_prompt_token_ids: true` returns the expanded prompt as the top-level `prompt_token_ids` (in every
  event of a stream) and `meta_info.image_tokens` counts the pads (absent without images);
- more pads than images (the processor's pre-expanded ids, say) is HTTP 500 `Internal Server Error` (a stream: the
  headers, then a dropped connection); fewer pads use the first images; no images leave pads as ordinary tokens;
- the radix cache keys images by content: the same request again is all cached but its last token; a second turn
  (stored ids with each run collapsed to one pad, every image in order) has its expanded prompt start with exactly the
  stored ids and all of them cached but the last; the images in another order miss from the first pad on;
- bad images are the tokenizer manager's 400s (`Non-base64 digit found`, `Could not decode image: ...`; a stream:
  one error event and `[DONE]`), wrong JSON types the contract gate's;
- `input_token_logprobs` report the pads by the id 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from support.images import CHECKS, IMG, RED, Encode, alone, data_url, generate, user_turn
from support.sglang_engine import Engines, assert_engine_clean


@pytest.fixture(scope="module")
def vl(engines: Engines) -> Iterator[tuple[httpx.Client, Path]]:
    engine = engines.get("vl")
    with httpx.Client(base_url=engine.url, timeout=600) as client:  # the first image request warms the processor up
        yield client, engines.checkpoint("qwen3-vl")
    engines.stop("vl")  # its ~3.7 GB back before the next module's engine starts


@pytest.fixture
def client(vl: tuple[httpx.Client, Path]) -> Iterator[httpx.Client]:
    client, _ = vl
    assert client.post("/flush_cache").status_code == 200
    yield client
    assert_engine_clean(str(client.base_url).rstrip("/"))


@pytest.fixture(scope="module")
def encode(vl: tuple[httpx.Client, Path]) -> Encode:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl[1])
    return lambda text: list(tok.encode(text, add_special_tokens=False))


def test_the_checkpoint_ships_the_published_image_processor(vl: tuple[httpx.Client, Path]) -> None:
    import json

    from trajectory.image_grid import QWEN3_VL, ImageGeometry

    config = json.loads((vl[1] / "preprocessor_config.json").read_text())
    assert ImageGeometry.from_preprocessor_config(config) == QWEN3_VL
    model = json.loads((vl[1] / "config.json").read_text())
    assert (model["image_token_id"], model["vision_start_token_id"], model["vision_end_token_id"]) == (
        151655, 151652, 151653)


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_image_wire_fact(client: httpx.Client, encode: Encode, check: Callable[[httpx.Client, Encode], None]) -> None:
    check(client, encode)


def test_a_remote_image_sglang_cannot_fetch_is_a_500(client: httpx.Client, encode: Encode) -> None:
    r = alone(client, {"input_ids": encode(user_turn(f"{IMG}x")), "image_data": "http://127.0.0.1:9/x.png"})
    assert (r.status_code, r.text) == (500, "Internal Server Error")


def test_engine_sessions_take_images(client: httpx.Client, encode: Encode) -> None:
    """Real SGLang accepts `image_data` on an engine session (sglang-sim refuses it: not emulated)."""
    session = client.post("/open_session", json={"capacity_of_str_len": 10000}).json()
    try:
        r = generate(client, encode(user_turn(f"{IMG}x")), data_url(RED), session_params={"id": session})
        assert r.status_code == 200 and r.json()["meta_info"]["image_tokens"] == 80
    finally:
        assert client.post("/close_session", json={"session_id": session}).status_code == 200
