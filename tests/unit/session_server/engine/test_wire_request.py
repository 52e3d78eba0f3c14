"""session_server.engine.wire: the /generate body from a GenerateRequest, byte for byte what the positional encoder
wrote (a property over every field), while both exist."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.engine.wire import GenerateRequest, encode_generate, encode_generate_positional
from trajectory.images import Image

PAD = 7
_IMAGES = [Image("sha256:" + "a" * 64, b"\x89PNG-one", 4, 3, "image/png"),
           Image("sha256:" + "b" * 64, b"\xff\xd8-two", 8, 2, "image/jpeg")]

_params = st.fixed_dictionaries(
    {"max_new_tokens": st.none() | st.integers(1, 2**31 - 1)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "json_schema": st.none() | st.just("{}"),
              "regex": st.none() | st.just("a+"), "stop": st.lists(st.text(max_size=3), max_size=2),
              "logit_bias": st.dictionaries(st.integers(0, 99).map(str), st.floats(-100, 100), max_size=2)})


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    ids = np.asarray(draw(st.lists(st.integers(0, 9), max_size=12)), dtype=np.int32)
    images = draw(st.sampled_from([(), _IMAGES[:1], _IMAGES]))
    return {
        "prompt_ids": ids, "start": draw(st.integers(0, len(ids))), "sp": draw(_params),
        "rid": draw(st.text("0123456789abcdef", min_size=32, max_size=32)),
        "session_params": draw(st.none() | st.fixed_dictionaries({"id": st.just("s-1")})),
        "routed_experts": draw(st.booleans()), "top_logprobs": draw(st.integers(0, 5)), "stream": draw(st.booleans()),
        "routed_experts_start": draw(st.integers(0, 12)), "stream_interval": draw(st.none() | st.integers(1, 64)),
        "thinking": draw(st.booleans()), "images": images, "image_pad": PAD if images else -1,
    }


@settings(max_examples=2000)
@given(requests())
def test_the_request_struct_encodes_what_the_positional_call_did(case: dict[str, Any]) -> None:
    old = encode_generate_positional(**case)
    new = encode_generate(GenerateRequest(
        input_ids=case["prompt_ids"], start=case["start"], sampling_params=case["sp"], rid=case["rid"],
        session_params=case["session_params"], routed_experts=case["routed_experts"],
        top_logprobs=case["top_logprobs"], stream=case["stream"], routed_experts_start=case["routed_experts_start"],
        stream_interval=case["stream_interval"], thinking=case["thinking"], images=case["images"],
        image_pad=case["image_pad"]))
    assert new == old
