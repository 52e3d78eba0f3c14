"""rollout.adapters.areal against AReaL 1.0.4: real samples into the trajectory dict `arun_episode` returns, checked by
AReaL's own `check_trajectory_format` and padded by its `concat_padded_tensors`, and `SessionWorkflow.arun_episode`
on a live session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import trainer_agents
from areal.api.workflow_api import RolloutWorkflow
from areal.infra.workflow_executor import check_trajectory_format
from areal.utils.data import concat_padded_tensors
from sample_checks import (
    Episodes,
    assert_tool_sample,
    expected_adapter_labels,
    expected_token_versions,
    run_episode,
    sampled_runs,
)

from rollout.adapters import areal as adapter
from rollout.adapters import verl
from support.stack import Stack, StackFactory

KEYS = {"input_ids", "loss_mask", "logprobs", "versions", "attention_mask", "rewards"}


def test_tool_episode_field_for_field(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    assert_tool_sample(sample)
    d = adapter.to_tensor_dict(episodes.tool.samples, reward=episodes.tool.reward)
    assert set(d) == KEYS
    assert check_trajectory_format(d, expected_keys=KEYS)
    assert d["input_ids"].dtype == torch.int32 and d["input_ids"].tolist() == [sample.tokens.tolist()]
    assert d["loss_mask"].tolist() == [sample.loss_mask.tolist()]
    assert np.array_equal(d["logprobs"][0].numpy(), sample.rollout_log_probs)
    versions = [int(v) if v is not None else -1 for v in expected_token_versions(sample)]
    assert d["versions"].tolist() == [versions] and set(versions) == {-1, 5, 7}
    assert d["attention_mask"].dtype == torch.bool and bool(d["attention_mask"].all())
    assert d["rewards"].tolist() == [trainer_agents.REWARD]


def test_compacted_session_is_one_row_per_segment(episodes: Episodes) -> None:
    samples = episodes.compacted.samples
    d = adapter.to_tensor_dict(samples, reward=episodes.compacted.reward)
    assert check_trajectory_format(d, expected_keys=KEYS)
    assert d["input_ids"].shape == (2, max(len(s.tokens) for s in samples))
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        assert d["input_ids"][row, :n].tolist() == sample.tokens.tolist()
        assert d["loss_mask"][row, :n].tolist() == sample.loss_mask.tolist()
        assert int(d["attention_mask"][row].sum()) == n and int(d["loss_mask"][row, n:].sum()) == 0
    assert d["rewards"].tolist() == [trainer_agents.REWARD] * 2
    # AReaL batches episodes with its own padding: the rows stay as they are
    batch = concat_padded_tensors([d, adapter.to_tensor_dict(episodes.tool.samples, reward=0.0)])
    assert batch["input_ids"].shape[0] == 3 and batch["rewards"].tolist() == [trainer_agents.REWARD] * 2 + [0.0]


def test_adapter_revisions_per_token_with_the_flag_and_batched_by_areal(episodes: Episodes) -> None:
    (lora,), (base,) = episodes.lora.samples, episodes.tool.samples
    d = adapter.to_tensor_dict([lora], reward=1.0, adapters=True)
    assert check_trajectory_format(d, expected_keys=KEYS | {"adapter_revisions"})
    assert d["adapter_revisions"] == [expected_adapter_labels(lora)]  # "a1@0" per sampled token, None elsewhere
    assert d["versions"].tolist() == [[int(v) if v is not None else -1 for v in expected_token_versions(lora)]]
    batch = concat_padded_tensors([d, adapter.to_tensor_dict([base], reward=0.0, adapters=True)])
    assert batch["adapter_revisions"] == [expected_adapter_labels(lora), expected_adapter_labels(base)]
    assert "adapter_revisions" not in adapter.to_tensor_dict([lora], reward=1.0)  # off unless asked


def test_session_workflow_runs_an_episode(episodes: Episodes) -> None:
    cls = adapter.SessionWorkflow
    assert issubclass(cls, RolloutWorkflow)
    workflow = cls(episodes.stack.server, "trainer_agents.tool_agent")
    d = asyncio.run(workflow.arun_episode(None, {"messages": "fix it", "task": 3}))
    assert d is not None and check_trajectory_format(d, expected_keys=KEYS)
    assert d["rewards"].tolist() == [trainer_agents.REWARD]
    assert set(d["versions"][0].tolist()) == {-1, 5, 7}
    sampled = d["loss_mask"][0].bool()
    assert bool((d["versions"][0][sampled] >= 0).all()) and bool((d["versions"][0][~sampled] == -1).all())


@pytest.fixture(scope="module")
def paced_stack(stack_factory: StackFactory) -> Iterator[Stack]:
    """An engine at 10 ms a token: a 1500-token reply outlasts by far a weight update sent after its 20th token. The
    server keeps a straddled reply as it ran (--straddled-replies keep; its default since issue 38 recomputes it under
    the new weights), so one turn holds tokens of two versions, the case this test maps."""
    with stack_factory(family="qwen3", sim_args=["--token-latency-ms", "10"],
                       servers={"server": ["--straddled-replies", "keep"]}) as stack:
        yield stack


def test_a_turn_sampled_across_a_weight_update_has_both_versions_per_token(paced_stack: Stack) -> None:
    episode = run_episode(paced_stack, trainer_agents.straddling_agent, metadata={"engine": paced_stack.engine})
    (sample,) = episode.samples
    ((start, end),) = sampled_runs(sample)
    d = adapter.to_tensor_dict(episode.samples, reward=episode.reward)
    versions = d["versions"][0].tolist()
    assert versions[:start] == [-1] * start and versions[end:] == [-1] * (len(versions) - end)
    turn = versions[start:end]
    switch = turn.index(9)
    assert switch >= 20 and set(turn[:switch]) == {5} and set(turn[switch:]) == {9}  # one turn, two versions
    (out,) = verl.to_agent_loop_outputs(episode.samples)
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (5, 9)
