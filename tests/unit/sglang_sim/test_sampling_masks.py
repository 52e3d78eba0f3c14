"""sglang-sim's `return_sampling_mask`: SGLang 0.5.23's keys, shapes, refusals and stream events, over a real
distribution (the support logprob is the full logprob renormalised over the kept set)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np
import pytest

from sglang_sim import wire
from sglang_sim.engine import Engine, EngineConfig
from sglang_sim.family import EngineFamily
from sglang_sim.requests import BadRequest, ValueRefusal, parse_generate

PROMPT = list(range(1000, 1030))


@pytest.fixture(scope="module")
def family(hf_tokenizers):
    return EngineFamily.create("qwen3", hf_tokenizers["qwen3"])


def reply(family: EngineFamily, sampling: dict[str, Any], config: EngineConfig | None = None,
          **body: Any) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        engine = Engine(config or EngineConfig(), family)
        inp = parse_generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, **sampling},
                              "return_logprob": True, **body}, family.vocab_size, None)
        req = engine.submit(inp)
        await asyncio.wait_for(req.done.wait(), 60)
        return wire.generate_body(engine, req, final=True, routed=None)
    return asyncio.run(run())


def masked(family: EngineFamily, sampling: dict[str, Any], mode: str | None = None) -> dict[str, Any]:
    extra = {} if mode is None else {"sampling_logprobs_mode": mode}
    return reply(family, sampling, return_sampling_mask=True, **extra)["meta_info"]


def test_rows_hold_the_sampled_id_within_top_k_and_renormalise_the_full_logprob(family) -> None:
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 20}
    selected, support = masked(family, sampling), masked(family, sampling, "support")
    n = selected["completion_tokens"]
    assert n > 0 and selected["output_token_sampling_mask_length"] == n
    assert selected["output_token_sampling_mask"] == support["output_token_sampling_mask"]
    for (full, token, _), row, chosen, values in zip(selected["output_token_logprobs"],
                                                     selected["output_token_sampling_mask"],
                                                     selected["output_token_sampling_logprobs"],
                                                     support["output_token_sampling_logprobs"], strict=True):
        assert token in row and 1 <= len(row) <= 20 and len(set(row)) == len(row)
        assert isinstance(chosen, float) and len(values) == len(row)
        assert abs(sum(math.exp(v) for v in values) - 1) < 1e-4  # a distribution over the kept set
        assert abs(values[row.index(token)] - chosen) < 1e-6
        assert chosen >= full - 1e-6  # the kept mass is at most one
    # Without masks the reply is the same one, without the keys.
    plain = reply(family, sampling)["meta_info"]
    assert plain["output_token_logprobs"] == selected["output_token_logprobs"]
    assert "output_token_sampling_mask" not in plain


def test_truncation_is_sglangs(family) -> None:
    """top_k bounds every row, a smaller top_p or a min_p keeps fewer ids, greedy keeps the argmax alone."""
    def lengths(**sampling: Any) -> list[int]:
        return [len(r) for r in masked(family, {"temperature": 1.0, **sampling})["output_token_sampling_mask"]]

    wide, narrow = lengths(top_k=50, top_p=1.0), lengths(top_k=50, top_p=0.6)
    assert max(wide) == 50 and all(n <= w for n, w in zip(narrow, wide, strict=True)) and narrow != wide
    assert all(n <= w for n, w in zip(lengths(top_k=50, min_p=0.2), wide, strict=True))
    assert lengths(top_k=5) == [5] * len(wide)
    greedy = masked(family, {"temperature": 0.0}, "support")
    assert greedy["output_token_sampling_mask"] == [[t] for _, t, _ in greedy["output_token_logprobs"]]
    assert greedy["output_token_sampling_logprobs"] == [[0.0]] * len(greedy["output_token_sampling_mask"])


@pytest.mark.parametrize(("sampling", "cap", "top_k"), [
    ({"temperature": 1.0, "top_p": 1.0, "top_k": -1}, 4096, 1 << 30),
    ({"temperature": 1.0, "top_p": 0.9}, 4096, 1 << 30),
    ({"temperature": 1.0, "top_k": 4097}, 4096, 4097),
    ({"temperature": 1.0, "top_k": 21}, 20, 21),
])
def test_a_top_k_the_mask_cannot_hold_is_refused(family, sampling: dict[str, Any], cap: int, top_k: int) -> None:
    with pytest.raises(BadRequest) as err:
        reply(family, sampling, EngineConfig(sampling_mask_max_tokens=cap), return_sampling_mask=True)
    assert str(err.value) == (f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
                              f"{cap}; got top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens.")
    assert reply(family, sampling, EngineConfig(sampling_mask_max_tokens=cap))["meta_info"]["completion_tokens"]


def test_a_logprobs_mode_without_masks_is_refused(family) -> None:
    with pytest.raises(ValueRefusal) as err:
        reply(family, {"temperature": 1.0, "top_k": 20}, sampling_logprobs_mode="support")
    assert str(err.value) == "sampling_logprobs_mode can only be set when return_sampling_mask=true."
    with pytest.raises(BadRequest):
        reply(family, {"temperature": 1.0, "top_k": 20}, return_sampling_mask=True, sampling_logprobs_mode="all")


@pytest.mark.parametrize("deltas", [False, True])
def test_stream_events_carry_the_rows(family, deltas: bool) -> None:
    """Cumulative events carry every row so far (deltas: the new rows), placed after the logprob lists."""
    async def run() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        engine = Engine(EngineConfig(incremental_streaming_output=deltas), family)
        inp = parse_generate({"input_ids": PROMPT, "stream": True, "return_logprob": True,
                              "return_sampling_mask": True, "sampling_params": {
                                  "max_new_tokens": 12, "temperature": 1.0, "top_k": 8}}, family.vocab_size, None)
        req = engine.submit(inp)
        await asyncio.wait_for(req.done.wait(), 60)
        events = wire.StreamEvents(engine, req, deltas)
        n = len(req.output_ids)
        bodies = [json.loads(events.event(count)) for count in range(1, n + 1, 3)]
        return bodies, wire.generate_body(engine, req, final=True, routed=None)

    bodies, final = asyncio.run(run())
    rows: list[list[int]] = []
    for body in bodies:
        meta = body["meta_info"]
        keys = list(meta)
        assert keys.index("output_token_logprobs_length") < keys.index("output_token_sampling_mask") \
            < keys.index("completion_tokens")
        rows = (rows if deltas else []) + meta["output_token_sampling_mask"]
        assert len(rows) == meta["output_token_sampling_mask_length"] == meta["completion_tokens"]
        assert len(meta["output_token_sampling_logprobs"]) == len(meta["output_token_sampling_mask"])
    assert rows == final["meta_info"]["output_token_sampling_mask"][:len(rows)]
    assert np.all([len(r) <= 8 for r in rows])


def overflowed(family: EngineFamily, sampling: dict[str, Any], cap: int = 64,
               **body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The final body of a request whose support overflows the cap mid-reply (the fault mask_overflow), and the
    same request's reply without the fault."""
    async def run(overflow: bool) -> dict[str, Any]:
        engine = Engine(EngineConfig(sampling_mask_max_tokens=cap), family)
        inp = parse_generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, **sampling},
                              "return_logprob": True, **body}, family.vocab_size, None)
        req = engine.submit(inp, mask_overflow=overflow)
        await asyncio.wait_for(req.done.wait(), 60)
        return wire.generate_body(engine, req, final=True, routed=None)
    return asyncio.run(run(True)), asyncio.run(run(False))


def test_a_support_past_the_cap_aborts_the_request_there_as_sglang_does(family) -> None:
    """batch_result_processor.py: the overflowing token is not emitted; the abort carries status 400 and SGLang's
    text naming the cap; the tokens before it are the undisturbed reply's."""
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 20}
    cut, whole = overflowed(family, sampling, return_sampling_mask=True)
    n = whole["meta_info"]["completion_tokens"]
    assert n == 24 and cut["output_ids"] == whole["output_ids"][:n // 2]
    meta = cut["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort", "status_code": 400, "err_type": "BadRequestError",
        "message": "Sampling support exceeds --sampling-mask-max-tokens=64, commonly because of cutoff ties. Lower "
                   "top_k to leave more headroom or increase the server limit."}
    assert meta["completion_tokens"] == meta["output_token_sampling_mask_length"] == n // 2
    assert meta["output_token_sampling_mask"] == whole["meta_info"]["output_token_sampling_mask"][:n // 2]
    # Nothing to overflow without masks, or with the greedy mask (the argmax alone).
    for sampling_, body in ((sampling, {}), ({"temperature": 0}, {"return_sampling_mask": True})):
        cut, whole = overflowed(family, sampling_, **body)
        assert cut["output_ids"] == whole["output_ids"] and len(cut["output_ids"]) == 24
        assert cut["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"] == {"type": "length",
                                                                                             "length": 24}
