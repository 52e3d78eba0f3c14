"""`image_data` in `/generate`, as SGLang 0.5.23 serves a Qwen3-VL checkpoint (tests/sglang/test_real_images_wire.py
pins every rule here against the real engine).

Why the sim cares: the session server sends one `<|image_pad|>` per image in `input_ids` plus every image of the
prompt in `image_data`, and stores the expanded prompt the engine returns (`return_prompt_token_ids`). The sim must
expand with the same grid arithmetic (trajectory/image_grid.py, the image decoded with PIL only for its size), refuse
what SGLang refuses in the same way, and key its radix cache by image content so `cached_tokens` behaves the same.

The rules, with P pads in `input_ids` and N images:
- P == N: pad i becomes image i's run of `t*h*w / merge**2` pads; P < N: the first P images are used, the rest are
  ignored; N == 0: pads are ordinary tokens. P > N >= 1 (the processor's expanded ids sent back, say) crashes
  SGLang's processor: HTTP 500 `Internal Server Error` (a stream: the headers, then a dropped connection).
- An image is a data URL or bare base64 (also `file://` or a path, read from disk); base64 SGLang cannot read or bytes
  PIL cannot open are the tokenizer manager's 400s; a remote URL is fetched by SGLang, never by the sim (a 500, what
  SGLang answers when the fetch fails).
- The radix key of an image's run is one value derived from the image's bytes, repeated: the same image in the same
  place is a cache hit, another image (or another order) misses from its first pad on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sglang_sim.serde_display import unexpected
from trajectory.image_grid import ImageGeometry, grid_thw, placeholder_count

_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
_KEY_SPACE = 2**31 - 1  # radix keys are int32


class ImageRefusal(Exception):
    """An image SGLang's tokenizer manager cannot load: a 400 (a stream: the error event), with SGLang's message."""


class EngineCrash(Exception):
    """What SGLang answers with an unhandled exception: HTTP 500 `Internal Server Error` (a stream: a dropped
    connection after the headers)."""


@dataclass(frozen=True)
class SimImage:
    """One decoded image: its content digest, size and the pad run it expands to."""

    digest: bytes
    width: int
    height: int
    grid: tuple[int, int, int]
    tokens: int

    def key_value(self, vocab_size: int) -> int:
        """The radix key of each of its pads: above the vocabulary, so it never equals a text token."""
        return vocab_size + int.from_bytes(self.digest[:8], "big") % (_KEY_SPACE - vocab_size)


def image_sources(raw: Any) -> tuple[str, ...]:
    """The image strings of an `image_data` field, in order; raises TypeError with the contract gate's text for a
    shape SGLang's API types refuse (a number, a boolean)."""
    if raw is None:
        return ()
    if isinstance(raw, str | dict):
        return (_source(raw),)
    if not isinstance(raw, list):
        raise TypeError(f"invalid type: {unexpected(raw)}, expected one of the MediaInput shapes")
    out: list[str] = []
    for item in raw:
        if item is None:
            continue
        if isinstance(item, list):  # a batch-shaped [[...]]: one request's images
            for inner in item:
                if not isinstance(inner, str | dict):
                    raise TypeError(f"invalid type: {unexpected(inner)}, expected one of the MediaItem shapes")
                out.append(_source(inner))
        elif isinstance(item, str | dict):
            out.append(_source(item))
        else:
            raise TypeError(f"invalid type: {unexpected(item)}, expected one of the MediaItem shapes")
    return tuple(out)


def _source(item: str | dict[str, Any]) -> str:
    if isinstance(item, str):
        return item
    url = item.get("url")
    return url if isinstance(url, str) else ""


def _b64decode(text: str) -> bytes:
    """pybase64.b64decode(validate=True), as SGLang calls it: one error text for every malformed input."""
    data = text.encode("ascii", errors="replace")
    try:
        if not _BASE64.fullmatch(data):
            raise binascii.Error
        return base64.b64decode(data, validate=True)
    except binascii.Error:
        raise ImageRefusal("Non-base64 digit found") from None


def image_bytes(source: str) -> bytes:
    """The file bytes of one `image_data` entry (sglang/srt/utils/common.py `get_image_bytes`)."""
    if source.startswith(("http://", "https://")):
        raise EngineCrash("sglang-sim does not fetch remote images")
    if source.startswith(("file://", "/")):
        path = source.removeprefix("file://")
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ImageRefusal(f"Could not decode image: {exc}") from None
    if source.startswith("data:"):
        _, _, source = source.partition(",")
    return _b64decode(source)


def load_image(source: str, geometry: ImageGeometry) -> SimImage:
    """Decode one image (PIL, for its size; the pixels are decoded too, as SGLang does, so a truncated file fails)."""
    from PIL import Image

    data = image_bytes(source)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            width, height = image.size
    except Exception as exc:  # PIL's own texts, as SGLang's `Could not decode image` wraps them
        raise ImageRefusal(f"Could not decode image: {exc}") from None
    try:
        grid = grid_thw(height, width, geometry)
    except ValueError as exc:  # an aspect ratio past 200: the processor's ValueError, unhandled in SGLang
        raise EngineCrash(str(exc)) from None
    return SimImage(digest=hashlib.sha256(data).digest(), width=width, height=height, grid=grid,
                    tokens=placeholder_count(grid, geometry.merge_size))


@dataclass(frozen=True)
class Expanded:
    """A prompt with its images expanded: the ids the engine reports and the radix key it caches them under."""

    prompt: np.ndarray
    key: np.ndarray
    images: tuple[SimImage, ...]  # the images used (the first P)

    @property
    def image_tokens(self) -> int:
        return sum(image.tokens for image in self.images)


def expand(ids: np.ndarray, images: list[SimImage], pad_id: int, vocab_size: int) -> Expanded:
    """Expand each pad of `ids` into its image's run (see the module's rules); raises EngineCrash for more pads than
    images."""
    pads = np.flatnonzero(ids == pad_id)
    if not images or len(pads) == 0:
        return Expanded(prompt=ids, key=ids, images=())
    if len(pads) > len(images):
        raise EngineCrash(f"IndexError: index {len(images)} is out of bounds for dimension 0 with size {len(images)}")
    used = tuple(images[: len(pads)])
    prompt_parts: list[np.ndarray] = []
    key_parts: list[np.ndarray] = []
    start = 0
    for position, image in zip(pads.tolist(), used, strict=True):
        text = ids[start:position]
        prompt_parts += [text, np.full(image.tokens, pad_id, dtype=np.int32)]
        key_parts += [text, np.full(image.tokens, image.key_value(vocab_size), dtype=np.int32)]
        start = position + 1
    prompt_parts.append(ids[start:])
    key_parts.append(ids[start:])
    return Expanded(prompt=np.concatenate(prompt_parts).astype(np.int32), key=np.concatenate(key_parts).astype(
        np.int32), images=used)
