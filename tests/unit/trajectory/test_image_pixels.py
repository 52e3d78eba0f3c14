"""trajectory/image_pixels.py: a sample carries its images as pixel values or as the agent's files, and the pixel
values computed from the files after either codec are the server's, bit for bit."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageDraw

from trajectory import (
    GenerateResult,
    LinearTrajectory,
    Sample,
    build_merged_sample,
    samples_from_json,
    samples_from_safetensors,
    samples_to_json,
    samples_to_safetensors,
    truncate_sample,
)
from trajectory.families.qwen3_vl import Qwen3VLFamily
from trajectory.image_grid import QWEN3_VL, ImageGeometry
from trajectory.image_pixels import image_files, pixel_values, with_image_bytes, with_image_pixels, with_pixel_values
from trajectory.images import Image, image_digest


def screen(width: int, height: int, i: int) -> Image:
    """A drawn picture (edges and text: the resize has something to interpolate), as the agent's PNG."""
    picture = PILImage.new("RGB", (width, height), (40 * i % 255, 90, 160))
    draw = ImageDraw.Draw(picture)
    draw.rectangle((10 + 9 * i, 20, width // 2, height // 2), fill=(250, 250, 240), outline=(0, 0, 0))
    draw.text((15 + 9 * i, 25), f"window {i}", fill=(0, 0, 0))
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    data = buffer.getvalue()
    return Image(image_digest(data), data, width, height, "image/png")


@pytest.fixture(scope="module")
def episode(families: dict[str, Any]) -> tuple[Sample, dict[str, Image]]:
    """A three-turn episode with a new image per turn (320x240 twice, one tall), its merged sample and its images."""
    vl = families["qwen3-vl"]  # the suite's, bound once per test process
    assert isinstance(vl, Qwen3VLFamily)
    traj = LinearTrajectory(vl)
    pictures = [screen(320, 240, 0), screen(320, 240, 1), screen(100, 500, 2)]
    history: list[dict[str, Any]] = []
    for k, picture in enumerate(pictures):
        history.append({"role": "user", "content": [{"type": "text", "text": f"turn {k}"},
                                                    {"type": "image", "image": picture}]})
        plan = traj.prepare(history)
        ids = vl.encode("ok<|im_end|>")
        done = GenerateResult(text="ok", output_ids=np.asarray(ids, np.int32),
                              logprobs=np.full(len(ids), -0.5, np.float32),
                              finish_reason={"type": "stop", "matched": ids[-1]},
                              prompt_tokens=len(plan.prompt_ids), completion_tokens=len(ids))
        traj.commit(plan, done, {"role": "assistant", "content": "ok"})
        history.append({"role": "assistant", "content": "ok"})
    return build_merged_sample(traj), dict(traj.images)


def test_pixel_values_from_the_files_equal_the_servers_after_either_codec(
        episode: tuple[Sample, dict[str, Image]]) -> None:
    sample, images = episode
    served = with_image_pixels(sample, images, QWEN3_VL)
    files = with_image_bytes(sample, images, QWEN3_VL)
    assert files.pixel_values is None and served.image_bytes is None
    assert image_files(files) == [images[i["digest"]].data for i in sample.metadata["images"]]
    for back in (samples_from_safetensors(samples_to_safetensors([files]))[0],
                 samples_from_json(json.loads(json.dumps(samples_to_json([files]))))[0]):
        assert np.array_equal(back.image_bytes, files.image_bytes)
        assert np.array_equal(back.image_byte_offsets, files.image_byte_offsets)
        local = with_pixel_values(back)  # the settings the server wrote into the sample
        assert local.pixel_values is not None and served.pixel_values is not None
        assert local.pixel_values.dtype == np.float32 and local.pixel_values.shape == served.pixel_values.shape
        assert np.array_equal(local.pixel_values, served.pixel_values)
        assert np.array_equal(local.image_grid_thw, served.image_grid_thw)
    assert len(samples_to_safetensors([files])) * 50 < len(samples_to_safetensors([served]))


def test_a_truncation_keeps_the_files_of_the_images_it_keeps(episode: tuple[Sample, dict[str, Image]]) -> None:
    sample, images = episode
    files = with_image_bytes(sample, images, QWEN3_VL)
    second = files.metadata["images"][1]["span"]
    cut = truncate_sample(files, second[0] + 3)  # inside the second run: it goes, with its file
    assert [i["digest"] for i in cut.metadata["images"]] == [sample.metadata["images"][0]["digest"]]
    assert image_files(cut) == image_files(files)[:1]
    assert np.array_equal(with_pixel_values(cut).pixel_values,
                          with_image_pixels(cut, images, QWEN3_VL).pixel_values)


def test_files_that_are_not_the_named_images_or_other_settings_are_refused(
        episode: tuple[Sample, dict[str, Image]]) -> None:
    sample, images = episode
    files = with_image_bytes(sample, images, QWEN3_VL)
    swapped = dataclasses.replace(files, metadata={**files.metadata, "images": files.metadata["images"][::-1]})
    with pytest.raises(ValueError, match="not the images its metadata names"):
        with_pixel_values(swapped)
    with pytest.raises(ValueError, match="differ from the sample's"):  # other settings, other grids
        with_pixel_values(files, ImageGeometry(min_pixels=512 * 512))
    bare = dataclasses.replace(files, metadata={k: v for k, v in files.metadata.items() if k != "image_processor"})
    with pytest.raises(ValueError, match="pass geometry"):
        with_pixel_values(bare)
    assert np.array_equal(with_pixel_values(bare, QWEN3_VL).pixel_values, with_pixel_values(files).pixel_values)
    with pytest.raises(ValueError, match="come together"):
        dataclasses.replace(files, image_byte_offsets=None)
    with pytest.raises(ValueError, match="come together"):
        dataclasses.replace(files, image_byte_offsets=files.image_byte_offsets + 1)
    assert with_pixel_values(sample) is sample  # no files: nothing to compute


def test_pixel_values_are_the_processors_for_the_familys_grids() -> None:
    """What samples carry: transformers' processor output for the images, one row per patch, grids as the family's."""
    files = [screen(320, 240, 0).data, screen(100, 500, 1).data]
    pixels, grids = pixel_values(files, QWEN3_VL, [[1, 16, 20], [1, 36, 8]])
    assert grids.tolist() == [[1, 16, 20], [1, 36, 8]] and pixels.dtype == np.float32
    assert pixels.shape == (16 * 20 + 36 * 8, 3 * 2 * 16 * 16)
    assert np.allclose(pixels[:320], pixel_values(files[:1], QWEN3_VL, [[1, 16, 20]])[0])  # per image: alone
    with pytest.raises(ValueError, match="differ from the sample's"):
        pixel_values(files, QWEN3_VL, [[1, 16, 20], [1, 8, 36]])
