"""rollout.adapters.slime and .miles: real samples into slime's and miles' `Sample` (faithful copies of the type
definitions at pinned commits, tests/trainers/upstream_types.py: neither project is on PyPI), and each project's
custom generate function run on a live session."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import trainer_agents
import upstream_types
from sample_checks import Episodes, assert_split, assert_tool_sample
from trainer_agents import LAYERS, TOP_K
from upstream_types import MilesSample, SlimeSample, Status

from rollout.adapters import miles, slime

upstream_types.install()


def check_slime_fields(out: SlimeSample | MilesSample, sample: object, base: SlimeSample | MilesSample) -> None:
    p = len(out.tokens) - out.response_length
    assert_split(sample, out.tokens[:p], out.tokens[p:], out.loss_mask, out.rollout_log_probs)  # type: ignore[arg-type]
    assert len(out.loss_mask) == len(out.rollout_log_probs) == out.response_length  # slime's own length rule
    assert out.weight_versions == sample.metadata["weight_versions"]  # type: ignore[attr-defined]
    assert out.metadata["weight_version_spans"] == sample.metadata["weight_version_spans"]  # type: ignore[attr-defined]
    assert out.prompt == base.prompt and out.label == base.label and out.index == base.index
    assert out.metadata["task"] == base.metadata["task"]
    assert out.status is Status.COMPLETED


def test_slime_tool_episode_field_for_field(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    assert_tool_sample(sample)
    base = SlimeSample(group_index=0, index=11, prompt="fix it", label="ok", metadata={"task": 3})
    (out,) = slime.to_samples(episodes.tool.samples, base, reward=episodes.tool.reward, expert_layers=LAYERS)
    assert type(out) is SlimeSample and out is not base
    out.validate_lengths()
    check_slime_fields(out, sample, base)
    assert out.weight_versions == ["5", "5", "7"]
    assert out.reward == trainer_agents.REWARD and out.rollout_id == 11  # the input's index when it has no rollout id
    assert isinstance(out.rollout_routed_experts, torch.Tensor)
    assert tuple(out.rollout_routed_experts.shape) == (len(sample.tokens) - 1, LAYERS, TOP_K)
    assert np.array_equal(out.rollout_routed_experts.numpy().reshape(len(sample.tokens) - 1, -1),
                          sample.routed_experts[:-1])
    assert base.tokens == [] and base.status is Status.PENDING  # the input is left as it was


def test_slime_and_miles_carry_each_engine_calls_adapter_revision(episodes: Episodes) -> None:
    (lora,) = episodes.lora.samples
    (out,) = slime.to_samples([lora], SlimeSample(index=1), reward=1.0, expert_layers=LAYERS)
    (mout,) = miles.to_miles_samples([lora], MilesSample(index=1), reward=1.0, expert_layers=LAYERS)
    for sample in (out, mout):
        assert sample.metadata["adapter_revisions"] == ["a1@0"] * 3  # one per engine call, beside weight_versions
        assert len(sample.weight_versions) == 3
    (plain,) = slime.to_samples(episodes.tool.samples, SlimeSample(index=2), reward=1.0, expert_layers=LAYERS)
    assert "adapter_revisions" not in plain.metadata


def test_slime_compacted_session_shares_one_rollout_id(episodes: Episodes) -> None:
    base = SlimeSample(index=4, rollout_id=40, prompt="p", metadata={"task": 1})
    outs = slime.to_samples(episodes.compacted.samples, base, reward=1.0, expert_layers=LAYERS)
    assert [o.rollout_id for o in outs] == [40, 40] and [o.metadata["segment"] for o in outs] == [0, 1]
    for out, sample in zip(outs, episodes.compacted.samples, strict=True):
        out.validate_lengths()
        assert out.tokens == sample.tokens.tolist() and out.reward == 1.0


def test_slime_wants_the_layer_count_for_experts(episodes: Episodes) -> None:
    with pytest.raises(ValueError, match="expert_layers"):
        slime.to_samples(episodes.tool.samples, SlimeSample(index=0))


def test_slime_generate_runs_an_episode(episodes: Episodes) -> None:
    args = SimpleNamespace(session_servers=[episodes.stack.server], num_layers=LAYERS,
                           custom_agent_function_path="trainer_agents.compacting_agent")
    base = SlimeSample(index=5, prompt="fix it", metadata={"task": 9})
    outs = asyncio.run(slime.generate(args, base, {"max_new_tokens": 512, "temperature": 1.0}))
    assert len(outs) == 2 and all(type(o) is SlimeSample for o in outs)
    assert [o.rollout_id for o in outs] == [5, 5] and all(o.reward == trainer_agents.REWARD for o in outs)
    assert all(o.metadata["agent_turns"] == 5 and o.metadata["task"] == 9 for o in outs)  # the agent's dict merged in
    for o in outs:
        o.validate_lengths()
        assert o.rollout_routed_experts.shape == (len(o.tokens) - 1, LAYERS, TOP_K)


def test_miles_tool_episode_field_for_field(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    base = MilesSample(index=2, rollout_id=20, prompt="fix it", label="ok", metadata={"task": 3})
    (out,) = miles.to_miles_samples(episodes.tool.samples, base, reward=episodes.tool.reward, expert_layers=LAYERS)
    assert type(out) is MilesSample
    check_slime_fields(out, sample, base)
    assert out.rollout_id == 20 and out.reward == trainer_agents.REWARD
    experts = out.rollout_routed_experts
    assert isinstance(experts, np.ndarray) and experts.dtype == np.int32  # miles' samples wire refuses other dtypes
    assert experts.shape == (len(sample.tokens) - 1, LAYERS, TOP_K)


def test_miles_generate_points_its_agent_at_an_external_server(episodes: Episodes) -> None:
    from miles.rollout.base_types import GenerateFnInput, GenerateFnOutput

    args = SimpleNamespace(session_servers=[episodes.stack.server], num_layers=LAYERS,
                           custom_agent_function_path="trainer_agents.compacting_agent")
    base = MilesSample(index=6, rollout_id=60, prompt="fix it", metadata={"task": 2})
    out = asyncio.run(miles.generate(GenerateFnInput(state=SimpleNamespace(args=args), sample=base,
                                                     sampling_params={"max_new_tokens": 512}, evaluation=False)))
    assert type(out) is GenerateFnOutput and len(out.samples) == 2
    assert [s.rollout_id for s in out.samples] == [60, 60]
    assert [s.metadata["segment"] for s in out.samples] == [0, 1]
    assert all(s.status is Status.COMPLETED and s.reward == trainer_agents.REWARD for s in out.samples)
