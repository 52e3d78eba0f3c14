"""How many `<|image_pad|>` ids an image becomes: the Qwen3-VL image processor's arithmetic, without torch or PIL.

The server stores the engine's expanded prompt (one pad per merged patch) and a trainer recomputes logprobs from it, so
the server, the emulated engine and the trainer must agree with SGLang on the patch grid of every image. SGLang 0.5.23
runs the checkpoint's own `Qwen2VLImageProcessor` (transformers) on each image, so the facts here are that processor's
`smart_resize` and the published Qwen3-VL / Qwen3.5 `preprocessor_config.json` (patch 16, merge 2, temporal patch 2,
pixels between 256x256 and 4096x4096, mean and std 0.5). tests/unit/trajectory/test_image_grid.py holds this module to
transformers' processor on random sizes.

A 320x240 image resizes to 320x256, a 16x20 patch grid, `1*16*20 / 2**2 = 80` pad ids.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = 256 * 256  # the processor's size.shortest_edge (a pixel count, despite the name)
MAX_PIXELS = 4096 * 4096  # size.longest_edge
MAX_ASPECT_RATIO = 200  # smart_resize refuses anything more elongated
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
RESCALE_FACTOR = 1 / 255

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
# The Qwen3 / Qwen3-VL vocabulary's ids for them; prefer `VisionTokens.from_tokenizer` where a tokenizer is at hand.
VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655


@dataclass(frozen=True)
class ImageGeometry:
    """An image processor's resize and patch settings (what `preprocessor_config.json` says)."""

    patch_size: int = PATCH_SIZE
    merge_size: int = MERGE_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple[float, float, float] = IMAGE_MEAN
    image_std: tuple[float, float, float] = IMAGE_STD

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged patch's side in pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> ImageGeometry:
        """Read a checkpoint's `preprocessor_config.json` (the `size` dict or the older min/max_pixels keys)."""
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels", size.get("shortest_edge", MIN_PIXELS))
        max_pixels = config.get("max_pixels", size.get("longest_edge", MAX_PIXELS))
        mean = config.get("image_mean", IMAGE_MEAN)
        std = config.get("image_std", IMAGE_STD)
        return cls(
            patch_size=int(config.get("patch_size", PATCH_SIZE)),
            merge_size=int(config.get("merge_size", MERGE_SIZE)),
            temporal_patch_size=int(config.get("temporal_patch_size", TEMPORAL_PATCH_SIZE)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=(float(mean[0]), float(mean[1]), float(mean[2])),
            image_std=(float(std[0]), float(std[1]), float(std[2])),
        )

    def preprocessor_config(self) -> dict[str, Any]:
        """The `preprocessor_config.json` a checkpoint ships so transformers and SGLang resize exactly like this."""
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "resample": 3,  # bicubic
            "rescale_factor": RESCALE_FACTOR,
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }


QWEN3_VL = ImageGeometry()


def smart_resize(height: int, width: int, geometry: ImageGeometry = QWEN3_VL) -> tuple[int, int]:
    """The (height, width) the processor resizes an image to: multiples of the factor, pixels within the bounds.

    Raises ValueError for an empty image or one more elongated than 200:1 (the processor refuses those too).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"an image must have positive sides, got {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio}")
    factor = geometry.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > geometry.max_pixels:
        beta = math.sqrt((height * width) / geometry.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < geometry.min_pixels:
        beta = math.sqrt(geometry.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_thw(height: int, width: int, geometry: ImageGeometry = QWEN3_VL) -> tuple[int, int, int]:
    """The image's `image_grid_thw`: (1, patch rows, patch columns) after the resize (one frame for a still image)."""
    resized_height, resized_width = smart_resize(height, width, geometry)
    return 1, resized_height // geometry.patch_size, resized_width // geometry.patch_size


def placeholder_count(grid: Sequence[int], merge_size: int = MERGE_SIZE) -> int:
    """How many `<|image_pad|>` ids SGLang expands one image into: t*h*w / merge_size**2."""
    t, h, w = grid
    return t * h * w // (merge_size * merge_size)


def image_token_count(height: int, width: int, geometry: ImageGeometry = QWEN3_VL) -> int:
    """`placeholder_count(grid_thw(height, width))`: the pads an image of this size becomes."""
    return placeholder_count(grid_thw(height, width, geometry), geometry.merge_size)


class _TokenizerByName(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


class _HFTokenizerByName(Protocol):
    def convert_tokens_to_ids(self, tokens: str) -> Any: ...


@dataclass(frozen=True)
class VisionTokens:
    """The ids of the vision markers in one vocabulary."""

    start: int = VISION_START_ID
    end: int = VISION_END_ID
    pad: int = IMAGE_PAD_ID

    @classmethod
    def from_tokenizer(cls, tokenizer: _TokenizerByName | _HFTokenizerByName) -> VisionTokens:
        """Look the markers up by name (a `tokenizers.Tokenizer` or a transformers tokenizer).

        Raises ValueError when the vocabulary lacks one of them (a text-only family).
        """
        ids = []
        for name in (VISION_START, VISION_END, IMAGE_PAD):
            if hasattr(tokenizer, "token_to_id"):
                found = tokenizer.token_to_id(name)
            else:
                found = tokenizer.convert_tokens_to_ids(name)
                if found == getattr(tokenizer, "unk_token_id", None):
                    found = None
            if not isinstance(found, int):
                raise ValueError(f"the tokenizer has no {name} token")
            ids.append(found)
        return cls(start=ids[0], end=ids[1], pad=ids[2])


QWEN3_VISION_TOKENS = VisionTokens()
