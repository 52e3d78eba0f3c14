"""POST /sessions/{id}/samples: the trajectory as training samples (docs/design.md 6).

`{"images": "pixels"}` (the default) gives an image sample's pixel values, computed here; `{"images": "bytes"}` the
files as the agent sent them and the processor's settings instead, a few kilobytes where the pixel values are
megabytes, for the trainer to compute the same pixel values itself (trajectory/image_pixels.py, docs/images.md).

The merged sample is snapshotted under the session lock (cheap array copies, no await inside), then truncated and
serialized on the CPU pool, so a large trajectory never stalls the loop. JSON by default; one safetensors payload
with `Accept: application/octet-stream`. The body is a list with one merged sample per segment of the session (one for
a single-line session, empty before the first turn; trajectory/session_segments.py), decoded by
trajectory.samples_from_json / samples_from_safetensors. A session whose latest turn the infrastructure failed (a 5xx,
and no turn committed since: Session.failure) gives samples with status "aborted" and the failure under
`metadata["abort"]` (trajectory/infrastructure.py), so a trainer drops them instead of scoring them. A session some
of whose turns an engine abort cut (a weight update) says on each sample what followed, counted over the session's
turns since this process holds it: `session_continuations` {recomputed, regenerated, stale, continued, ...: n}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from session_server.api.sessions import lookup
from session_server.frontend.fields import MAX_INT32, is_int
from session_server.http.body import read_object
from session_server.state import server_of
from trajectory import (
    Sample,
    abort_samples,
    build_segment_samples,
    samples_to_json,
    samples_to_safetensors,
    truncate_sample,
)
from trajectory.errors import RequestValidationError
from trajectory.image_pixels import IMAGE_FORMS, ImageForm, with_image_bytes, with_image_pixels
from trajectory.images import Image, Vision

OCTET_STREAM = "application/octet-stream"
_encoder = msgspec.json.Encoder()


def _max_seq_len(obj: dict[str, Any]) -> int | None:
    value = obj.get("max_seq_len")
    if value is None:
        return None
    if not is_int(value) or not 1 <= value <= MAX_INT32:
        raise RequestValidationError(f"'max_seq_len' must be an integer in [1, {MAX_INT32}]")
    return value


def _image_form(obj: dict[str, Any]) -> ImageForm:
    value = obj.get("images", "pixels")
    for form in IMAGE_FORMS:
        if value == form:
            return form
    raise RequestValidationError(f"'images' must be one of {list(IMAGE_FORMS)}")


def _encode(samples: list[Sample], max_seq_len: int | None, binary: bool, images: Mapping[str, Image],
            vision: Vision | None, form: ImageForm = "pixels") -> bytes:
    if vision is not None:
        attach = with_image_bytes if form == "bytes" else with_image_pixels
        samples = [attach(s, images, vision.geometry) if s.metadata.get("images") else s for s in samples]
    if max_seq_len is not None:
        samples = [truncate_sample(s, max_seq_len) for s in samples]
    return samples_to_safetensors(samples) if binary else _encoder.encode(samples_to_json(samples))


async def collect_samples(request: Request) -> Response:
    server = server_of(request)
    session = lookup(server, request.path_params["session_id"])
    config = server.config
    body = await read_object(request, config.max_request_bytes, config.body_timeout)
    max_seq_len, form = _max_seq_len(body), _image_form(body)
    async with session.lock:
        segments = sorted(session.segments, key=lambda s: s.id)
        samples = build_segment_samples([(s, s.trajectory) for s in segments],
                                        lineage=None if session.lineage is None else session.lineage.info())
        if (failure := session.failure) is not None:  # the episode ended because the infrastructure failed it
            samples = abort_samples(samples, failure)
        if session.continuations:  # what the server recomputed, regenerated or refused in this session's turns
            for sample in samples:
                sample.metadata["session_continuations"] = dict(session.continuations)
        images = {d: i for s in segments for d, i in s.trajectory.images.items()}  # stores are replaced, not mutated
    binary = OCTET_STREAM in request.headers.get("accept", "")
    payload = await server.pool.run(_encode, samples, max_seq_len, binary, images, server.family.vision, form)
    return Response(payload, media_type=OCTET_STREAM if binary else "application/json")
