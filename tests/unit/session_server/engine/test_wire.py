"""session_server.engine.wire: the /generate body a GenerateRequest encodes to, pinned byte for byte.

These bytes are what the positional encoder wrote before the request became a struct (checked then by a property
over 2000 random requests): SGLang 0.5.23 accepts exactly these keys (tests/e2e/test_engine_wire.py holds the sim and
the engine to them), so a change here is a change of the engine contract, docs/design.md 5.1.
"""

from __future__ import annotations

import numpy as np
import pytest

from session_server.engine.wire import GenerateRequest, encode_generate, encode_ids
from trajectory.images import Image

PAD = 7
IDS = np.array([1, 2, PAD, PAD, PAD, 3, 4], dtype=np.int32)
IMAGE = Image("sha256:" + "a" * 64, b"\x89PNG-one", 4, 3, "image/png")
HEAD = b'"return_logprob":true,"logprob_start_len":-1'

TABLE = [
    pytest.param(
        GenerateRequest(input_ids=IDS, sampling_params={"max_new_tokens": None}, rid="r1"),
        b'{"input_ids":[1,2,7,7,7,3,4],"sampling_params":{"max_new_tokens":null},' + HEAD + b',"rid":"r1",'
        b'"stream":false}', id="plain"),
    pytest.param(
        GenerateRequest(input_ids=IDS, start=5, sampling_params={"max_new_tokens": 8, "regex": "a+"}, rid="r2",
                        session_params={"id": "s-1"}, stream=True, stream_interval=32, top_logprobs=2,
                        routed_experts=True, routed_experts_start=5, thinking=True),
        b'{"input_ids":[3,4],"sampling_params":{"max_new_tokens":8,"regex":"a+","stream_interval":32},' + HEAD
        + b',"rid":"r2","stream":true,"session_params":{"id":"s-1"},"return_routed_experts":true,'
        b'"routed_experts_start_len":5,"top_logprobs_num":2,"require_reasoning":true}', id="every-option"),
    pytest.param(  # images: the whole prompt with each pad run collapsed; no interval unstreamed; thinking, no grammar
        GenerateRequest(input_ids=IDS, start=5, sampling_params={"max_new_tokens": 8}, rid="r3", stream_interval=32,
                        thinking=True, images=(IMAGE,), image_pad=PAD),
        b'{"input_ids":[1,2,7,3,4],"sampling_params":{"max_new_tokens":8},' + HEAD + b',"rid":"r3","stream":false,'
        b'"image_data":["data:image/png;base64,iVBORy1vbmU="]}', id="images"),
]


@pytest.mark.parametrize(("request_", "body"), TABLE)
def test_the_body_is_pinned(request_: GenerateRequest, body: bytes) -> None:
    assert encode_generate(request_) == body


def test_the_stream_interval_does_not_touch_the_turns_params() -> None:
    params = {"max_new_tokens": 8}
    encode_generate(GenerateRequest(input_ids=IDS, sampling_params=params, rid="r", stream=True, stream_interval=4))
    assert params == {"max_new_tokens": 8}  # a continuation reuses them


def test_size_counts_what_is_sent() -> None:
    assert GenerateRequest(input_ids=IDS, start=5, sampling_params={}, rid="r").size == 8
    assert GenerateRequest(input_ids=IDS, sampling_params={}, rid="r", images=(IMAGE,)).size == 28 + len(IMAGE.data)


@pytest.mark.parametrize("start, images", [(0, ()), (5, ()), (0, (IMAGE,))])
def test_ids_encoded_ahead_give_the_same_body(start: int, images: tuple[Image, ...]) -> None:
    """A primed prompt's ids are encoded once for its group (TurnPlan.wire_ids): the body is the one encoding them
    per request gives; with an engine session's `start` or images the ids sent are not the whole prompt's, so the
    encoded array is not used."""
    def body(**extra: object) -> bytes:
        return encode_generate(GenerateRequest(input_ids=IDS, start=start, sampling_params={"max_new_tokens": 4},
                                               rid="r", images=images, image_pad=PAD, **extra))  # type: ignore[arg-type]

    assert body(input_json=encode_ids(IDS)) == body()
    assert encode_ids(IDS) == b"[1,2,7,7,7,3,4]"
    used = b'"input_ids":[9],' in body(input_json=b"[9]")  # the array given is what is sent, unchecked
    assert used == (not start and not images)
