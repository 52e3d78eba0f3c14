"""trajectory/image_grid.py agrees with transformers' Qwen2VLImageProcessor (what SGLang runs) on every image size."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from tokenizers import Tokenizer

from support.examples import examples
from trajectory import image_grid
from trajectory.image_grid import (
    QWEN3_VL,
    ImageGeometry,
    VisionTokens,
    grid_thw,
    image_token_count,
    placeholder_count,
    smart_resize,
)


def _auto_image_processor() -> Any:
    """transformers' image processors, imported by the tests that read them: the import costs 1.5 s of CPU, which a
    test process that runs none of them (collection imports every test module) need not pay."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor


@pytest.fixture(scope="module")
def hf_smart_resize() -> Callable[..., tuple[int, int]]:
    """transformers' own smart_resize for Qwen2-VL-style processors (imported only where read, as above)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The processor transformers builds from the preprocessor_config.json the tiny checkpoint ships."""
    directory = tmp_path_factory.mktemp("processor")
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL.preprocessor_config()))
    return _auto_image_processor().from_pretrained(str(directory))


def test_the_issue_example_320x240_is_16x20_patches_80_pads(processor: object) -> None:
    assert smart_resize(240, 320) == (256, 320)
    assert grid_thw(240, 320) == (1, 16, 20)
    assert placeholder_count((1, 16, 20)) == 80
    assert image_token_count(240, 320) == 80
    out = processor(images=[Image.new("RGB", (320, 240))], return_tensors="np")  # type: ignore[operator]
    assert out["image_grid_thw"].tolist() == [[1, 16, 20]]
    assert out["pixel_values"].shape == (320, 3 * 2 * 16 * 16)


def test_the_shipped_config_is_the_published_qwen3_vl_one(processor: object) -> None:
    size = processor.size  # type: ignore[attr-defined]
    assert (size.shortest_edge, size.longest_edge) == (65536, 16777216)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)  # type: ignore[attr-defined]
    assert list(processor.image_mean) == [0.5, 0.5, 0.5] and list(processor.image_std) == [0.5, 0.5, 0.5]  # type: ignore[attr-defined]
    assert ImageGeometry.from_preprocessor_config(QWEN3_VL.preprocessor_config()) == QWEN3_VL
    legacy = {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14}
    assert ImageGeometry.from_preprocessor_config(legacy) == ImageGeometry(
        patch_size=14, min_pixels=3136, max_pixels=1003520
    )


sides = st.integers(min_value=1, max_value=20000)


@settings(max_examples=examples(2000), deadline=None)
@given(height=sides, width=sides)
def test_smart_resize_is_transformers_smart_resize(hf_smart_resize: Callable[..., tuple[int, int]], height: int,
                                                  width: int) -> None:
    try:
        expected = hf_smart_resize(height, width, factor=32, min_pixels=65536, max_pixels=16777216)
    except ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(height, width)
        return
    assert smart_resize(height, width) == expected
    h, w = expected
    assert h % 32 == 0 and w % 32 == 0 and 65536 <= h * w <= 16777216


LEGACY = ImageGeometry(patch_size=14, min_pixels=3136, max_pixels=1003520)  # Qwen2-VL's numbers


@pytest.fixture(scope="module")
def processors(tmp_path_factory: pytest.TempPathFactory) -> dict[ImageGeometry, object]:
    """transformers' processor for each geometry, built from the config this module writes."""
    out: dict[ImageGeometry, object] = {}
    for geometry in (QWEN3_VL, LEGACY):
        directory = tmp_path_factory.mktemp(f"p{geometry.patch_size}")
        (directory / "preprocessor_config.json").write_text(json.dumps(geometry.preprocessor_config()))
        out[geometry] = _auto_image_processor().from_pretrained(str(directory))
    return out


@settings(max_examples=examples(300), deadline=None)
@given(height=sides, width=sides, geometry=st.sampled_from([QWEN3_VL, LEGACY]))
def test_the_pad_count_is_the_processors_patch_count_over_merge_squared(
    processors: dict[ImageGeometry, object], height: int, width: int, geometry: ImageGeometry
) -> None:
    if max(height, width) / min(height, width) > 200:
        return
    patches = processors[geometry].get_number_of_image_patches(height, width)  # type: ignore[attr-defined]
    assert image_token_count(height, width, geometry) * 4 == patches
    assert placeholder_count(grid_thw(height, width, geometry)) == patches // 4


@settings(max_examples=examples(25), deadline=None)
@given(height=st.integers(min_value=1, max_value=700), width=st.integers(min_value=1, max_value=700))
def test_grid_matches_the_processor_on_real_images(processor: object, height: int, width: int) -> None:
    if max(height, width) / min(height, width) > 200:
        return
    out = processor(images=[Image.new("RGB", (width, height), (200, 30, 60))], return_tensors="np")  # type: ignore[operator]
    grid = tuple(out["image_grid_thw"][0].tolist())
    assert grid == grid_thw(height, width)
    assert out["pixel_values"].shape[0] == grid[0] * grid[1] * grid[2]


def test_refusals(hf_smart_resize: Callable[..., tuple[int, int]]) -> None:
    for height, width in [(0, 10), (10, 0), (-3, 5)]:
        with pytest.raises(ValueError, match="positive"):
            smart_resize(height, width)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201)
    assert (
        smart_resize(1, 200) == hf_smart_resize(1, 200, factor=32, min_pixels=65536, max_pixels=16777216) == (32, 3648)
    )


def test_vision_tokens_are_read_from_the_qwen3_tokenizer_by_name(hf_tokenizers: dict[str, Any]) -> None:
    tokenizer: Tokenizer = hf_tokenizers["qwen3"].backend_tokenizer  # the Rust tokenizer, as the server holds it
    tokens = VisionTokens.from_tokenizer(tokenizer)
    assert tokens == image_grid.QWEN3_VISION_TOKENS == VisionTokens(151652, 151653, 151655)
    assert tokenizer.id_to_token(tokens.pad) == "<|image_pad|>"

    class NoVision:
        def token_to_id(self, token: str) -> int | None:
            return None

    with pytest.raises(ValueError, match="vision_start"):
        VisionTokens.from_tokenizer(NoVision())
