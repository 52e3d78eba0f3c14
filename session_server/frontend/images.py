"""Images in a request, read and checked once for every API: what each front end's image part becomes.

Chat Completions' `image_url` parts, Responses' `input_image` and Anthropic's `image` blocks are all mapped (their
protocol.py) onto the chat part `{"type": "image_url", "image_url": {"url": ...}, "where": <the API's own path>}`;
here each becomes `{"type": "image", "image": trajectory.images.Image}`, which the trajectory turns into the image's
mark and hash (trajectory/messages.py). So every API refuses a bad image with the same rule, in its own error shape,
naming its own field.

The rules, each a 400 that says which: a data URL (`data:image/...;base64,...`) or, only when the operator allows
fetching (`--fetch-images`), an http(s) URL read with a byte and a time limit; at most `max_images` images in a
request; at most `max_bytes` per encoded image; a file Pillow recognises as PNG, JPEG, WebP, GIF or BMP; at most
`max_pixels` pixels, read from the file's header BEFORE anything is decoded (a decompression bomb is a few kilobytes
of PNG that inflates to gigabytes: its header says so), then decoded in full so a truncated or corrupt file is
refused here rather than by the engine. An image the session already holds (same content hash) is not decoded again.

Pure but for the optional fetch; runs where the turn's parse runs (on the CPU pool for large bodies; always there
when fetching is on, turns/pipeline.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trajectory import ModelFamily
from trajectory.errors import RequestValidationError
from trajectory.image_grid import ImageGeometry
from trajectory.images import Image, ImageLimits, Vision, image_digest

# Formats SGLang's loader (PIL) and transformers' processor both read; the reply's MIME type is the file's, not the
# client's word for it.
_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}


def _refuse(where: str, why: str) -> RequestValidationError:
    return RequestValidationError(f"'{where}' {why}")


def _data_url(where: str, url: str, limits: ImageLimits) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        raise _refuse(where, "must be a base64 data URL (data:image/png;base64,...)")
    if len(payload) > (limits.max_bytes + 2) // 3 * 4 + 4:  # before decoding: base64 is 4/3 of the bytes
        raise _refuse(where, f"is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(where, "is not valid base64") from None


def _fetch(where: str, url: str, limits: ImageLimits) -> bytes:
    """An http(s) URL's body, at most `max_bytes` of it, within `fetch_timeout` (per socket operation and in total,
    as the read stops once the budget is spent)."""
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout) as reply:
            data: bytes = reply.read(limits.max_bytes + 1)
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        raise _refuse(where, f"could not be fetched: {exc}") from None
    if len(data) > limits.max_bytes:
        raise _refuse(where, f"is larger than {limits.max_bytes} bytes")
    return data


def read_image(where: str, url: Any, limits: ImageLimits, known: Mapping[str, Image] | None = None) -> Image:
    """The checked image of one URL (see the module docstring for the rules)."""
    if not isinstance(url, str) or not url:
        raise _refuse(where, "must be a non-empty URL string")
    if url.startswith("data:"):
        data = _data_url(where, url, limits)
    elif url.startswith(("http://", "https://")):
        if not limits.fetch:
            raise _refuse(where, "is a remote URL: this server takes images as base64 data URLs only (the operator "
                                 "may allow fetching with --fetch-images)")
        data = _fetch(where, url, limits)
    else:
        raise _refuse(where, "must be a base64 data URL (data:image/png;base64,...)")
    if len(data) > limits.max_bytes:
        raise _refuse(where, f"is larger than {limits.max_bytes} bytes")
    digest = image_digest(data)
    if known is not None and (seen := known.get(digest)) is not None:
        return seen
    return _decode(where, data, digest, limits)


def _decode(where: str, data: bytes, digest: str, limits: ImageLimits) -> Image:
    from PIL import Image as PILImage  # imported on the first image: a text-only server never loads Pillow
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data)) as image:  # reads the header only
            width, height, kind = image.width, image.height, image.format
            if kind not in _FORMATS:
                raise _refuse(where, f"is a {kind} image; accepted: {', '.join(sorted(_FORMATS))}")
            if width * height > limits.max_pixels:
                raise _refuse(where, f"has {width}x{height} pixels, more than the {limits.max_pixels} allowed")
            with warnings.catch_warnings():
                warnings.simplefilter("error", PILImage.DecompressionBombWarning)
                image.load()  # the whole file: a truncated or corrupt image is refused here, not by the engine
    except RequestValidationError:
        raise
    except PILImage.DecompressionBombError:  # Pillow's own bound, far above ours, refused it at the header
        raise _refuse(where, f"declares more pixels than the {limits.max_pixels} allowed") from None
    except UnidentifiedImageError:
        raise _refuse(where, "is not an image (PNG, JPEG, WebP, GIF or BMP)") from None
    except (OSError, ValueError, SyntaxError, PILImage.DecompressionBombWarning) as exc:
        raise _refuse(where, f"is not a readable image: {exc}") from None
    if width < 1 or height < 1:
        raise _refuse(where, "has no pixels")
    return Image(digest=digest, data=data, width=width, height=height, mime=_FORMATS[kind])


def with_processor_config(family: ModelFamily, directory: str) -> ModelFamily:
    """`family` with the image settings of the `preprocessor_config.json` in `directory` (the checkpoint's, beside its
    tokenizer), when it is a vision family and the file is there: SGLang resizes by the checkpoint's processor, so the
    pad counts must come from the same file. Else `family` as it is (the published Qwen3-VL settings)."""
    path = Path(directory, "preprocessor_config.json")
    if family.vision is not None and path.is_file():
        geometry = ImageGeometry.from_preprocessor_config(json.loads(path.read_text()))
        family.vision = Vision(family.vision.tokens, geometry)
    return family


def _image_url(part: dict[str, Any]) -> Any:
    """The URL of a chat `image_url` part (`{"url": ...}`, or the bare string some clients send)."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, dict) else value


def read_images(messages: Any, limits: ImageLimits, vision: bool, family: str,
                known: Mapping[str, Image] | None = None) -> Any:
    """`messages` (raw chat messages) with every `image_url` part read into an `image` part; messages without one
    are passed on as the same objects (the matcher's fast path recognises them). `vision`: the family takes images;
    if not, any image is a 400 naming its field. `known`: the session's images, not decoded again."""
    if not isinstance(messages, list):
        return messages
    # Only messages with a list content can hold an image part: found in one pass in C-level code, since an agent
    # resends its whole history every turn (mostly string contents) and this runs on every turn.
    listed = [i for i, m in enumerate(messages) if type(m) is dict and type(m.get("content")) is list]
    out: list[Any] | None = None
    count = 0
    for i in listed:
        message = messages[i]
        content = message["content"]
        if not any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            continue
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "image_url"):
                parts.append(part)
                continue
            where = part.get("where") or f"messages[{i}].content[{j}]"
            if not vision:
                raise _refuse(f"{where}.type", f"is an image: model family {family} takes text only")
            count += 1
            if count > limits.max_images:
                raise _refuse(where, f"is image {count}: a request may carry at most {limits.max_images} images")
            parts.append({"type": "image", "image": read_image(where, _image_url(part), limits, known)})
        if out is None:
            out = list(messages)
        out[i] = {**message, "content": parts}
    return messages if out is None else out
