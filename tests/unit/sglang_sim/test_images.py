"""sglang_sim/images.py: the `image_data` shapes, decoding and pad-expansion rules SGLang 0.5.23 follows."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from sglang_sim.images import EngineCrash, ImageRefusal, SimImage, expand, image_sources, load_image
from support.examples import examples
from support.images import collapse_pads
from trajectory.image_grid import IMAGE_PAD_ID, QWEN3_VL, image_token_count

VOCAB = 151680
PAD = IMAGE_PAD_ID


def png(width: int, height: int, color: tuple[int, int, int] = (1, 2, 3)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image(tokens: int, tag: bytes = b"a") -> SimImage:
    return SimImage(digest=tag * 32, width=1, height=1, grid=(1, 2, 2 * tokens), tokens=tokens)


def test_image_data_shapes() -> None:
    assert image_sources(None) == () and image_sources([]) == () and image_sources([[]]) == ()
    assert image_sources("a") == ("a",) and image_sources(["a", None, "b"]) == ("a", "b")
    assert image_sources([["a", "b"]]) == ("a", "b") and image_sources({"url": "u"}) == ("u",)
    for bad, shape in ((5, "MediaInput"), (True, "MediaInput"), (["a", 5], "MediaItem"), ([[1.5]], "MediaItem")):
        with pytest.raises(TypeError, match=f"expected one of the {shape} shapes"):
            image_sources(bad)


def test_decoding_data_urls_and_bare_base64_alike() -> None:
    data = png(320, 240)
    from_url = load_image(f"data:image/png;base64,{b64(data)}", QWEN3_VL)
    assert from_url == load_image(b64(data), QWEN3_VL)
    assert (from_url.width, from_url.height, from_url.grid, from_url.tokens) == (320, 240, (1, 16, 20), 80)
    assert load_image(b64(png(320, 240, (9, 9, 9))), QWEN3_VL).digest != from_url.digest


@pytest.mark.parametrize("source", ["not an image", "data:image/png;base64,!!!!", "AAA", "x", " AAAA"])
def test_malformed_base64_is_pybase64s_one_message(source: str) -> None:
    with pytest.raises(ImageRefusal, match=r"^Non-base64 digit found$"):
        load_image(source, QWEN3_VL)


def test_undecodable_and_truncated_images_are_refused() -> None:
    with pytest.raises(ImageRefusal, match=r"^Could not decode image: cannot identify image file"):
        load_image(b64(b"hello world!"), QWEN3_VL)
    with pytest.raises(ImageRefusal, match=r"^Could not decode image"):
        load_image(b64(png(300, 300, (5, 6, 7))[:-40]), QWEN3_VL)
    with pytest.raises(EngineCrash):
        load_image("https://example.invalid/x.png", QWEN3_VL)  # the sim never fetches
    with pytest.raises(EngineCrash, match="aspect ratio"):
        load_image(b64(png(1000, 4)), QWEN3_VL)


def test_files_are_read_from_disk(tmp_path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(png(64, 64))
    assert load_image(str(path), QWEN3_VL).tokens == load_image(f"file://{path}", QWEN3_VL).tokens == 64
    with pytest.raises(ImageRefusal, match="Could not decode image"):
        load_image(str(tmp_path / "missing.png"), QWEN3_VL)


def test_expansion_rules() -> None:
    ids = np.array([1, 151652, PAD, 151653, 2, PAD, 3], dtype=np.int32)
    a, b = image(3, b"a"), image(2, b"b")
    out = expand(ids, [a, b], PAD, VOCAB)
    assert out.prompt.tolist() == [1, 151652, PAD, PAD, PAD, 151653, 2, PAD, PAD, 3]
    assert out.images == (a, b) and out.image_tokens == 5
    ka, kb = a.key_value(VOCAB), b.key_value(VOCAB)
    assert out.key.tolist() == [1, 151652, ka, ka, ka, 151653, 2, kb, kb, 3]
    assert min(ka, kb) >= VOCAB and max(ka, kb) < 2**31 and ka != kb
    assert expand(ids, [a, b, image(7, b"c")], PAD, VOCAB).images == (a, b)  # extra images are ignored
    no_images = expand(ids, [], PAD, VOCAB)
    assert no_images.prompt is ids and no_images.images == ()
    with pytest.raises(EngineCrash, match="IndexError"):
        expand(ids, [a], PAD, VOCAB)  # more pads than images


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.one_of(st.integers(0, 50), st.just(PAD)), max_size=30), st.lists(st.integers(1, 9), max_size=6))
def test_expansion_collapses_back_and_keys_pads_only(tokens: list[int], counts: list[int]) -> None:
    ids = np.asarray(tokens, dtype=np.int32)
    images = [image(n, bytes([i + 1])) for i, n in enumerate(counts)]
    pads = tokens.count(PAD)
    if images and pads > len(images):
        with pytest.raises(EngineCrash):
            expand(ids, images, PAD, VOCAB)
        return
    out = expand(ids, images, PAD, VOCAB)
    used = images[:pads] if images else []
    assert len(out.prompt) == len(tokens) + sum(n - 1 for n in counts[: len(used)])
    assert (out.key != out.prompt).sum() == sum(counts[: len(used)])
    assert np.all(out.prompt[out.key != out.prompt] == PAD)
    if used:
        assert collapse_pads(out.prompt.tolist()) == collapse_pads(tokens)


def test_the_grid_is_trajectory_image_grids() -> None:
    for width, height in ((1920, 1080), (33, 999), (4000, 3000)):
        loaded = load_image(b64(png(width, height)), QWEN3_VL)
        assert loaded.tokens == image_token_count(height, width)
