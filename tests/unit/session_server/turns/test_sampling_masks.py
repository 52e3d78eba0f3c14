"""turns/sampling_masks.py: with masks on, what cannot be replayed exactly is a 400 naming the field, before any
engine call; a request without a top-k bound gets the configured one."""

from __future__ import annotations

from typing import Any

import pytest

from session_server.config import ServerConfig
from session_server.engine.wire import GenerateRequest, encode_generate
from session_server.sessions.session import Session
from session_server.turns.sampling_masks import SamplingMaskPolicy, UnreplayableSamplingError, mask_policy

POLICY = SamplingMaskPolicy(default_top_k=None, max_top_k=4096)


@pytest.mark.parametrize(("sp", "field"), [
    ({"temperature": 1.0, "top_p": 0.9}, "'top_k'"),                      # top-p without a top-k bound
    ({"temperature": 1.0}, "'top_k'"),                                    # no truncation at all
    ({"temperature": 1.0, "top_k": -1}, "'top_k'"),
    ({"temperature": 1.0, "top_k": 4097}, "'top_k' 4097"),                # past the engine's cap
    ({"top_k": 20, "presence_penalty": 0.5}, "'presence_penalty'"),
    ({"top_k": 20, "frequency_penalty": -0.1}, "'frequency_penalty'"),
    ({"top_k": 20, "repetition_penalty": 1.1}, "'repetition_penalty'"),
    ({"top_k": 20, "logit_bias": {"5": 1.0}}, "'logit_bias'"),
])
def test_what_cannot_be_replayed_is_refused_naming_the_field(sp: dict[str, Any], field: str) -> None:
    with pytest.raises(UnreplayableSamplingError) as err:
        POLICY.apply(dict(sp))
    assert err.value.status == 400 and err.value.message.startswith(field)


def test_what_can_be_replayed_passes_with_its_bound() -> None:
    assert POLICY.apply({"temperature": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.1}) == 20
    assert POLICY.apply({"top_k": 4096, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {}}) == 4096
    assert POLICY.apply({"temperature": 0}) == 1  # greedy: one id per row, whatever top_k says
    sp: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9}
    assert SamplingMaskPolicy(default_top_k=50).apply(sp) == 50 and sp["top_k"] == 50  # the session's default


def test_a_session_asks_for_masks_as_it_was_created() -> None:
    config = ServerConfig(engine_url="http://e", tokenizer="t", model_family="qwen3", sampling_mask_top_k=20)
    session = Session(id="s", segments=None, metadata={})  # type: ignore[arg-type]
    assert mask_policy(config, session) is None
    session.sampling_masks = True
    assert mask_policy(config, session) == SamplingMaskPolicy(20, 4096)
    on = ServerConfig(engine_url="http://e", tokenizer="t", model_family="qwen3", return_sampling_masks=True)
    assert mask_policy(on, Session(id="s", segments=None, metadata={})) is not None  # type: ignore[arg-type]
    assert mask_policy(on, Session(id="s", segments=None, metadata={}, sampling_masks=False)) is None  # type: ignore


def test_the_engine_is_asked_for_masks_in_mode_selected() -> None:
    body = encode_generate(GenerateRequest(input_ids=[1, 2], sampling_params={"top_k": 20}, rid="r",
                                           sampling_masks=True))
    assert b'"return_sampling_mask":true,"sampling_logprobs_mode":"selected"' in body
    assert b"sampling_mask" not in encode_generate(GenerateRequest(input_ids=[1], sampling_params={}, rid="r"))
