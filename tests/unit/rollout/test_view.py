"""rollout.view rebuilds a sample's images from its pixel values: the Qwen2-VL processor's flattening undone."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

from rollout.view import image_pixels
from trajectory.image_grid import QWEN3_VL


def processor() -> object:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    g = QWEN3_VL
    return Qwen2VLImageProcessorPil(patch_size=g.patch_size, merge_size=g.merge_size,
                                    temporal_patch_size=g.temporal_patch_size, image_mean=list(g.image_mean),
                                    image_std=list(g.image_std),
                                    size={"shortest_edge": g.min_pixels, "longest_edge": g.max_pixels})


def picture() -> Image.Image:
    image = Image.new("RGB", (320, 240), (40, 70, 110))
    draw = ImageDraw.Draw(image)
    draw.rectangle((30, 30, 210, 180), fill=(250, 250, 250), outline=(0, 0, 0))
    draw.rectangle((50, 150, 110, 170), fill=(0, 120, 215))
    out = io.BytesIO()
    image.save(out, "PNG")
    return Image.open(io.BytesIO(out.getvalue())).convert("RGB")


def test_rebuilt_pixels_processed_again_give_the_same_pixel_values() -> None:
    process = processor()
    first = process(images=[picture()], return_tensors="np")  # type: ignore[operator]
    grid = first["image_grid_thw"][0]
    assert grid.tolist() == [1, 16, 20]
    rgb = image_pixels(np.asarray(first["pixel_values"], np.float64), grid, QWEN3_VL)
    assert rgb.shape == (256, 320, 3) and rgb.dtype == np.uint8
    again = process(images=[Image.fromarray(rgb)], return_tensors="np")  # type: ignore[operator]
    # Already at the processor's size: only the byte rounding of the rebuilt pixels (1/255, normalised by std 0.5).
    assert np.abs(again["pixel_values"] - first["pixel_values"]).max() <= 1 / 255 / 0.5 + 1e-6
    assert rgb[40, 40].tolist() == [250, 250, 250] and rgb[5, 5].tolist() == [40, 70, 110]
