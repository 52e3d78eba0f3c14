"""What every adapter test asserts of the samples themselves and of a prompt/response cut against them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.adapters import SessionEpisode, run_session
from rollout.client import SessionClient
from support.stack import Stack
from trajectory import Sample

TOOL_VERSIONS = ("5", "7")  # trainer_agents.tool_agent: turns 1-2 on "5", turn 3 on "7"
LORA = "a1"  # the LoRA adapter the sim serves (conftest.py), revision 0: "a1@0" in the trainers' fields


@dataclass
class Episodes:
    """The session-scoped real episodes every adapter test converts (tests/trainers/conftest.py)."""

    stack: Stack
    tool: SessionEpisode       # one segment, three turns, two tool results masked, versions 5 and 7
    compacted: SessionEpisode  # two segments of one session
    lora: SessionEpisode       # the tool episode's agent on a session pinned to the adapter LORA


def sampled_runs(sample: Sample) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def assert_tool_sample(sample: Sample) -> None:
    """The tool episode is what the adapters are checked on: three generated turns with tool output between them
    (masked 0), two weight versions, routed experts on every fed token."""
    runs = sampled_runs(sample)
    assert len(runs) == 3, runs
    assert runs[1][0] > runs[0][1] and runs[2][0] > runs[1][1]  # tool output between the turns
    assert sample.routed_experts is not None and (sample.routed_experts[:-1] >= 0).all()
    spans = sample.metadata["weight_version_spans"]
    assert {v for v, _, _ in spans} == set(TOOL_VERSIONS)


def assert_split(sample: Sample, prompt: Any, response: Any, mask: Any, logprobs: Any) -> None:
    """A trainer's prompt / response / mask / logprobs are exactly the sample cut at its first prompt."""
    p = len(sample.tokens) - sample.response_length
    assert list(prompt) == sample.tokens[:p].tolist()
    assert list(response) == sample.tokens[p:].tolist()
    assert list(prompt) + list(response) == sample.tokens.tolist()
    assert [int(m) for m in mask] == sample.loss_mask[p:].tolist()
    assert np.array_equal(np.asarray(logprobs, dtype=np.float32), sample.rollout_log_probs[p:])
    # tool output inside the response is masked and carries no logprob
    off = np.asarray(mask) == 0
    assert off.any() or sample.metadata.get("num_turns") == 1
    assert np.all(np.asarray(logprobs, dtype=np.float32)[off] == 0.0)


def expected_token_versions(sample: Sample) -> list[str | None]:
    """Per token: the version of the turn whose run holds it (tool_agent: "5", "5", "7"), None off the mask."""
    out: list[str | None] = [None] * len(sample.tokens)
    versions = sample.metadata["weight_versions"]
    for (start, end), version in zip(sampled_runs(sample), versions, strict=True):
        for i in range(start, end):
            out[i] = version
    return out


def expected_adapter_labels(sample: Sample) -> list[str | None]:
    """Per token: "a1@0" on a token the LORA episode sampled, "" on a base-model one, None off the mask."""
    adapters = sample.metadata.get("adapters") or []
    label = f"{LORA}@0" if adapters and all(a == [LORA, "0"] for a in adapters) else ""
    return [label if m else None for m in sample.loss_mask.tolist()]


def run_episode(stack: Stack, agent: Any, **kwargs: Any) -> SessionEpisode:
    """One session of `agent` on the stack's server, its samples collected (rollout.adapters.run_session)."""
    async def main() -> SessionEpisode:
        async with SessionClient(stack.server) as client:
            return await run_session(client, agent, **kwargs)

    return asyncio.run(main())
