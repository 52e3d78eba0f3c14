"""How much of a prompt the sim reads from its radix cache: SGLang's `_compute_max_prefix_len` (schedule_batch.py).

The prompt's last token is always computed, and so are the input logprobs a request asks for from an explicit
`logprob_start_len` on (released SGLang 0.5.23: a repeated prompt with `logprob_start_len: 0` reports 0 cached tokens,
with -1 all but the last), except on a streaming session, which ignores `logprob_start_len`.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sglang_sim.engine import Engine, EngineConfig
from sglang_sim.family import EngineFamily
from sglang_sim.generation import SamplingParams
from sglang_sim.requests import GenerateInput


@pytest.fixture(scope="module")
def family(hf_tokenizers, families):
    return EngineFamily.create("qwen3", hf_tokenizers["qwen3"], family=families["qwen3"])


async def _cached(engine: Engine, rid: str, ids: np.ndarray, **options) -> int:
    req = engine.submit(GenerateInput(rid=rid, input_ids=ids, text=None, sampling=SamplingParams(max_new_tokens=2),
                                      **options))
    await asyncio.wait_for(req.done.wait(), 60)
    return req.cached_tokens


def test_input_logprobs_limit_the_cached_prefix(family):
    async def run() -> list[int]:
        engine = Engine(EngineConfig(kv_capacity_tokens=4000), family)
        ids = np.arange(1000, 1040, dtype=np.int32)
        first = await _cached(engine, "warm", ids)
        return [first,
                await _cached(engine, "plain", ids),
                await _cached(engine, "no-logprobs", ids, logprob_start_len=0),  # ignored without return_logprob
                await _cached(engine, "from-0", ids, return_logprob=True, logprob_start_len=0),
                await _cached(engine, "from-7", ids, return_logprob=True, logprob_start_len=7),
                await _cached(engine, "output-only", ids, return_logprob=True, logprob_start_len=-1),
                await _cached(engine, "past-the-end", ids, return_logprob=True, logprob_start_len=99)]

    assert asyncio.run(run()) == [0, 39, 39, 0, 7, 39, 39]
