"""The pixel values of a sample's images, computed where they are needed: the server's or the trainer's side.

Pixel values are what a vision tower takes: float32 rows of `3 * temporal_patch * patch * patch` per patch, about
1.9 MB for one 320x240 screenshot, whose PNG is a few kilobytes. A sample can therefore carry either (samples.py):

- `"pixels"`: `pixel_values` and `image_grid_thw`, computed by the server;
- `"bytes"`: the encoded files exactly as the agent sent them (`image_bytes`, CSR by `image_byte_offsets`, in the
  order of `metadata["images"]`, which names each one's span, hash and grid) and the processor's settings
  (`metadata["image_processor"]`, a `preprocessor_config.json`), so the trainer computes the same pixel values with
  `with_pixel_values`: one function, one processor (transformers' Qwen2-VL PIL image processor), on both sides.

Pure (PIL and transformers are imported on the first image: a text-only process never loads them).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .image_grid import ImageGeometry
from .images import Image, image_digest
from .samples import Sample

# How a sample carries its images: the processed pixel values, or the files the agent sent.
ImageForm = Literal["pixels", "bytes"]
IMAGE_FORMS: tuple[ImageForm, ...] = ("pixels", "bytes")


@functools.lru_cache(maxsize=4)
def _processor(geometry: ImageGeometry) -> Any:
    """transformers' Qwen2-VL image processor (the PIL one: no torch needed) with these settings."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=geometry.patch_size, merge_size=geometry.merge_size,
        temporal_patch_size=geometry.temporal_patch_size, image_mean=list(geometry.image_mean),
        image_std=list(geometry.image_std), size={"shortest_edge": geometry.min_pixels,
                                                  "longest_edge": geometry.max_pixels})


def pixel_values(files: Sequence[bytes], geometry: ImageGeometry,
                 grids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """What the model's vision tower takes for these encoded images: (float32 [patches, dim], int64 [images, 3]
    grids), as transformers' processor makes them. `grids`: the `image_grid_thw` the tokens were expanded with; the
    processor's must be the same (ValueError otherwise: other settings would misplace every patch). CPU-heavy (a
    screenshot is a few milliseconds): the server runs it on its pool."""
    from PIL import Image as PILImage

    if not files:
        return np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int64)
    opened = [PILImage.open(io.BytesIO(data)) for data in files]
    out = _processor(geometry)(images=opened, return_tensors="np")
    pixels, got = np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)
    if got.tolist() != [list(grid) for grid in grids]:
        raise ValueError(f"image processor grids {got.tolist()} differ from the sample's {[list(g) for g in grids]}")
    return pixels, got


def _digests(sample: Sample) -> list[str]:
    return [str(image["digest"]) for image in sample.metadata.get("images") or ()]


def _grids(sample: Sample) -> list[list[int]]:
    return [list(image["image_grid_thw"]) for image in sample.metadata.get("images") or ()]


def with_image_pixels(sample: Sample, images: Mapping[str, Image], geometry: ImageGeometry) -> Sample:
    """`sample` carrying the pixel values of the images its metadata names (the server's `"pixels"` form)."""
    files = [images[digest].data for digest in _digests(sample)]
    pixels, grids = pixel_values(files, geometry, _grids(sample))
    return dataclasses.replace(sample, pixel_values=pixels, image_grid_thw=grids)


def with_image_bytes(sample: Sample, images: Mapping[str, Image], geometry: ImageGeometry) -> Sample:
    """`sample` carrying the encoded files of the images its metadata names and the processor's settings (the
    `"bytes"` form: the trainer computes the pixel values with `with_pixel_values`)."""
    files = [images[digest].data for digest in _digests(sample)]
    offsets = np.zeros(len(files) + 1, np.int64)
    offsets[1:] = np.cumsum([len(data) for data in files])
    metadata = {**sample.metadata, "image_processor": geometry.preprocessor_config()}
    return dataclasses.replace(sample, metadata=metadata,
                               image_bytes=np.frombuffer(b"".join(files), np.uint8).copy(),
                               image_byte_offsets=offsets)


def image_files(sample: Sample) -> list[bytes]:
    """The encoded files a `"bytes"` sample carries, in the order of `metadata["images"]`."""
    data, offsets = sample.image_bytes, sample.image_byte_offsets
    if data is None or offsets is None:
        return []
    raw = data.tobytes()
    return [raw[a:b] for a, b in itertools.pairwise(offsets.tolist())]


def with_pixel_values(sample: Sample, geometry: ImageGeometry | None = None) -> Sample:
    """`sample` with the pixel values of the image files it carries, as the server would have computed them (the
    same function on the same bytes). `geometry`: the processor's settings; by default the ones the server wrote
    into the sample (`metadata["image_processor"]`). A sample without image files is returned as it is. ValueError
    where the files are not the images the metadata names (count or content hash) or the grids disagree."""
    files = image_files(sample)
    if not files:
        return sample
    if [image_digest(data) for data in files] != _digests(sample):
        raise ValueError("the sample's image files are not the images its metadata names (count or content hash)")
    if geometry is None:
        config = sample.metadata.get("image_processor")
        if not isinstance(config, dict):
            raise ValueError("the sample names no image processor settings (metadata.image_processor): pass geometry")
        geometry = ImageGeometry.from_preprocessor_config(config)
    pixels, grids = pixel_values(files, geometry, _grids(sample))
    return dataclasses.replace(sample, pixel_values=pixels, image_grid_thw=grids)
