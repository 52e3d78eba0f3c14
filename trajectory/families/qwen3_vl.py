"""Qwen3-VL: Qwen3's ChatML, reasoning and tool calls, plus images (trajectory/images.py).

The template writes an image as `<|vision_start|><|image_pad|><|vision_end|>` where it sits in a user, tool or system
message's content, and the engine expands the one pad into a run per merged patch (image_grid.py). What a vision family
adds to a text family is only those facts (`Vision`: the marker ids of its vocabulary and its image processor's
settings, the published Qwen3-VL `preprocessor_config.json` unless the server reads the checkpoint's own); TITO,
matching and samples handle images the same way for every family that has them (Qwen3.5 too, qwen35.py).

The checkpoints this project serves carry Qwen3's tokenizer and template (the released Qwen3-VL template renders a
message's text and image parts in order, which is what rendering the content with the marker block in place of each
image gives, and it cannot be had without a model hub).
"""

from __future__ import annotations

from typing import Any

from ..image_grid import QWEN3_VL, ImageGeometry, VisionTokens
from ..images import Vision
from .qwen3 import Qwen3Family


def vision_of(tokenizer: Any, geometry: ImageGeometry = QWEN3_VL) -> Vision | None:
    """The family's image facts in this tokenizer's vocabulary; None when it lacks the markers (a text-only one)."""
    try:
        return Vision(VisionTokens.from_tokenizer(tokenizer), geometry)
    except ValueError:
        return None


class Qwen3VLFamily(Qwen3Family):
    name = "qwen3-vl"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.vision = vision_of(tokenizer)
