"""Images in a trajectory: where they sit in messages and in stored tokens, and what the engine is sent for them.

Vision-language families (Qwen3-VL, Qwen3.5) write each image as `<|vision_start|><|image_pad|><|vision_end|>` and the
engine expands the one pad into a run of N pads, one per merged patch of the resized image (image_grid.py). TITO keeps
what the model saw, so the stored tokens hold the expanded runs (loss mask 0, like any prompt token). The engine,
though, must get ONE pad per image plus `image_data` with every image of the prompt in order (SGLang 0.5.23 answers
500 to a pre-expanded run): `collapse` turns stored tokens back into that form, `expand` turns a rendered prompt into
the stored form. A run is a maximal block of pads: two images never touch (each run sits between its own start and
end markers), so the runs of a token sequence are its images, in order.

In a normalised message an image is the reserved character `IMAGE_MARK` in the content text (where the template puts
the marker block) plus its content hash in the message's `images` list; the image itself (the encoded file as the
client sent it, and its size) lives once per session in a store keyed by that hash. So messages stay small and
JSON-plain, two requests that carry the same picture match, and a later turn never decodes or re-processes an earlier
image: the engine's radix cache keys images by content too.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import RequestValidationError
from .image_grid import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    ImageGeometry,
    VisionTokens,
    grid_thw,
    placeholder_count,
)

# Where an image sits in a normalised message's text: a Unicode noncharacter (reserved for a program's internal use,
# never valid in interchange), so no client text means it; a client text that holds it is refused.
IMAGE_MARK = "\ufdd0"
# What a vision family's template writes for one image (Qwen2-VL, Qwen3-VL and Qwen3.5 alike).
IMAGE_SPELLING = VISION_START + IMAGE_PAD + VISION_END


@dataclass(frozen=True, slots=True)
class Image:
    """One image as a request carried it, checked (session_server/frontend/images.py): the encoded file and its size."""

    digest: str     # "sha256:<hex>" of `data`: the image's identity in messages, samples and the engine's cache
    data: bytes     # the encoded file (PNG, JPEG, ...) exactly as received
    width: int
    height: int
    mime: str       # "image/png", ...

    def data_url(self) -> str:
        """The image as SGLang's `image_data` takes it (a data URL: no file or network access on the engine)."""
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """The operator's bounds on a request's images (session_server/config.py; checked by
    session_server/frontend/images.py)."""

    max_images: int = 32                 # per request, the resent history's included
    max_bytes: int = 10 * 1024 * 1024    # per encoded image
    max_pixels: int = 4096 * 4096        # per image, width x height as the file declares it
    fetch: bool = False                  # http(s) URLs allowed (else only data URLs)
    fetch_timeout: float = 5.0           # seconds for one fetch, connect to last byte


NO_IMAGE_LIMITS = ImageLimits()  # the defaults: where no operator set any


def image_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class Vision:
    """A family's image facts: the marker ids in its vocabulary and its processor's resize and patch settings."""

    tokens: VisionTokens
    geometry: ImageGeometry

    def grid(self, image: Image) -> tuple[int, int, int]:
        """The image's `image_grid_thw` (t, h, w in patches); a 400 for a size the processor refuses."""
        try:
            return grid_thw(image.height, image.width, self.geometry)
        except ValueError as exc:
            raise RequestValidationError(f"image {image.digest[:19]}: {exc}") from exc

    def count(self, image: Image) -> int:
        """How many pads the engine expands the image into."""
        return placeholder_count(self.grid(image), self.geometry.merge_size)


# -- messages ------------------------------------------------------------------------------------------------------

def message_images(message: Mapping[str, Any]) -> list[str]:
    """The content hashes of a normalised message's images, in order ([] for a message without images)."""
    images = message.get("images")
    return list(images) if images else []


def prompt_images(messages: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every image of a prompt in order: the `image_data` list of the engine request for these messages."""
    return [digest for message in messages for digest in message_images(message)]


def spelled(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image mark replaced by the template's marker block, ready to render (messages without
    images are passed through as they are)."""
    out = []
    for message in messages:
        if message.get("images"):
            message = {k: v for k, v in message.items() if k != "images"}
            message["content"] = message["content"].replace(IMAGE_MARK, IMAGE_SPELLING)
        out.append(message)
    return out


def has_images(messages: Iterable[Mapping[str, Any]]) -> bool:
    return any(message.get("images") for message in messages)


def collect_images(messages: Any) -> dict[str, Image]:
    """The `Image` objects a raw (front-end-read) request carries, by hash: its `image` content parts."""
    found: dict[str, Image] = {}
    if not isinstance(messages, list):
        return found
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(image := part.get("image"), Image):
                    found[image.digest] = image
    return found


# -- token ids -----------------------------------------------------------------------------------------------------

def runs(ids: np.ndarray, pad: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of `pad` in `ids`, in order: the images' spans in a token sequence."""
    is_pad = np.concatenate(([False], np.asarray(ids) == pad, [False]))
    edges = np.flatnonzero(is_pad[1:] != is_pad[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def collapse(ids: np.ndarray, pad: int) -> np.ndarray:
    """Each run of pads as one pad: the `input_ids` SGLang expands itself (int32; `ids` itself when it has no pad)."""
    ids = np.asarray(ids)
    is_pad = ids == pad
    if not is_pad.any():
        return ids
    keep = ~(is_pad[1:] & is_pad[:-1])
    return np.concatenate((ids[:1], ids[1:][keep])).astype(np.int32, copy=False)


def expand(ids: np.ndarray, pad: int, counts: Sequence[int]) -> np.ndarray:
    """The i-th pad of `ids` (one per image) as `counts[i]` pads: the prompt as the engine expands it (int32).

    A pad count other than the number of images is the client's doing (a control-token spelling in text that the
    operator lets through as the token, `--special-tokens-in-content engine`): a 400.
    """
    ids = np.asarray(ids, dtype=np.int32)
    positions = np.flatnonzero(ids == pad)
    if len(positions) != len(counts):
        raise RequestValidationError(
            f"the rendered prompt holds {len(positions)} image placeholders for {len(counts)} images")
    if not len(counts):
        return ids
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[positions] = counts
    return np.repeat(ids, repeats)


def mrope_positions(length: int, spans: Sequence[Sequence[int]], grids: Sequence[Sequence[int]],
                    merge_size: int) -> np.ndarray:
    """The multimodal RoPE positions (temporal, height, width) of a `length`-token sequence whose images have these
    pad-run `spans` and `image_grid_thw` grids, as Qwen3-VL's `get_rope_index` computes them: text counts up on all
    three axes; an image's run is its merged-patch grid offset by the position where it starts, and the text after it
    resumes at that position + the grid's larger side. int32 [3, length]."""
    out = np.empty((3, length), dtype=np.int32)
    position = cursor = 0
    for (start, end), (t, h, w) in zip(spans, grids, strict=True):
        out[:, cursor:start] = np.arange(start - cursor) + position
        position += start - cursor
        rows, columns = h // merge_size, w // merge_size
        if (end - start) != t * rows * columns:
            raise ValueError(f"an image run of {end - start} pads for a grid of {t}x{rows}x{columns}")
        grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(rows), np.arange(columns), indexing="ij")
        out[0, start:end] = grid_t.ravel() + position
        out[1, start:end] = grid_h.ravel() + position
        out[2, start:end] = grid_w.ravel() + position
        position += max(h, w) // merge_size
        cursor = end
    out[:, cursor:] = np.arange(length - cursor) + position
    return out


def check_runs(ids: np.ndarray, vision: Vision, images: Sequence[Image]) -> list[tuple[int, int]]:
    """The spans of `images` in `ids`, checked: one run per image, of the length its grid gives (else a 400)."""
    spans = runs(ids, vision.tokens.pad)
    counts = [vision.count(image) for image in images]
    if [end - start for start, end in spans] != counts:
        raise RequestValidationError(
            f"the prompt's image placeholder runs {[e - s for s, e in spans]} do not match its images' {counts}")
    return spans
