"""Issues 38 / 42 / 39 at every trainer's seam, against the trainers' own classes: an episode the infrastructure
ended reaches each trainer as its dropped or masked rollout, the sampling masks reach the trainers that have a field
(SkyRL's `rollout_sample_support`, checked by SkyRL's own validator and its packer's shape rule) and the others'
extras, and a forked session's lineage where the trainer has a place for it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import trainer_agents
from areal.infra.workflow_executor import check_trajectory_format
from areal.utils.data import concat_padded_tensors
from sample_checks import Episodes, run_episode
from skyrl.backends.skyrl_train.utils.sample_support import validate_sample_support
from skyrl.train.generators.base import TrajectoryID
from test_adapter_skyrl import validated
from upstream_types import MilesSample, SlimeSample, Status

from rollout.adapters import areal, miles, skyrl, slime, trl, verl
from rollout.infrastructure import EpisodeAbortedError
from trajectory import InfrastructureAbort, Sample, abort_samples, infrastructure_abort
from trajectory.sampling_masks import SamplingMasks

WIDTH = 3
ENGINE_DIED = InfrastructureAbort("engine_unavailable", "engine_unavailable", 502, "gone", 2, "server")


def _lineage(group: str, position: int) -> dict[str, object]:
    return {"parent_session": "root", "fork_position": position, "fork_turns": 1, "group": group,
            "root_session": "root", "depth": 1}


def with_masks(sample: Sample, lineage: dict[str, object] | None = None) -> Sample:
    """The sample with a kept set per sampled token (its own id first, up to WIDTH ids), empty rows elsewhere."""
    rows = [[int(t), (int(t) + 1) % 1000, (int(t) + 2) % 1000][: 1 + i % WIDTH] if m else []
            for i, (t, m) in enumerate(zip(sample.tokens, sample.loss_mask, strict=True))]
    out = Sample(sample.tokens.copy(), sample.loss_mask.copy(), sample.rollout_log_probs.copy(),
                 sample.response_length, sample.status,
                 {**sample.metadata, **({"lineage": lineage} if lineage else {})}, sample.routed_experts)
    out.set_masks(SamplingMasks.from_rows(rows, (sample.rollout_log_probs * 0.5).tolist()))
    return out


@pytest.fixture(scope="module")
def failed(episodes: Episodes) -> object:
    """A session whose second turn the engine answered 500: the agent gave up with the SDK's error."""
    episode = run_episode(episodes.stack, trainer_agents.failing_agent)
    assert episode.aborted and episode.reward is None
    return episode


def test_an_agent_failed_by_the_engine_gives_samples_the_server_marked(failed: object) -> None:
    (sample,) = failed.samples  # type: ignore[attr-defined]
    abort = infrastructure_abort(sample)
    assert sample.status == "aborted" and abort is not None
    assert (abort.cause, abort.status, abort.turns, abort.source) == ("engine_refused", 500, 1, "server")


def test_verl_drops_the_group_by_raising_or_masks_the_output(episodes: Episodes) -> None:
    (sample,) = abort_samples(episodes.tool.samples, ENGINE_DIED)
    (output,) = verl.to_agent_loop_outputs([sample], reward=0.0, expert_layers=trainer_agents.LAYERS)
    assert set(output.response_mask) == {0} and output.extra_fields["abort"] == ENGINE_DIED.info()
    assert output.extra_fields["status"] == "aborted"
    assert int(output.as_dict()["response_mask"].sum()) == 0  # verl's own conversion: nothing to train on
    cls = verl.SessionAgentLoop
    loop = cls(servers=episodes.stack.server, agent="trainer_agents.failing_agent")
    with pytest.raises(EpisodeAbortedError, match="engine_refused"):
        asyncio.run(loop.run({}, raw_prompt="x"))
    masked = asyncio.run(cls(servers=episodes.stack.server, agent="trainer_agents.failing_agent",
                             on_abort="mask").run({}, raw_prompt="x"))
    assert set(masked.response_mask) == {0} and masked.extra_fields["abort"]["cause"] == "engine_refused"


def test_verl_extra_fields_carry_masks_lineage_and_version_counts(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    masked = with_masks(sample, _lineage("g", 5))
    (output,) = verl.to_agent_loop_outputs([masked], reward=1.0, expert_layers=trainer_agents.LAYERS)
    fields = output.extra_fields
    assert fields["lineage"] == _lineage("g", 5)
    assert fields["weight_version_tokens"] == {"5": fields["weight_versions"].count("5"),
                                               "7": fields["weight_versions"].count("7")}
    assert len(fields["sampling_mask_offsets"]) == len(output.response_ids) + 1
    assert set(output.response_mask) == {0, 1}


def test_slime_and_miles_remove_the_sample(episodes: Episodes) -> None:
    (sample,) = abort_samples(episodes.tool.samples, ENGINE_DIED)
    (item,) = slime.to_samples([sample], SlimeSample(index=3), expert_layers=trainer_agents.LAYERS)
    assert (item.status, item.remove_sample) == (Status.ABORTED, True)
    assert item.metadata["abort"] == ENGINE_DIED.info()
    item.validate_lengths()
    (kept,) = miles.to_miles_samples([with_masks(episodes.tool.samples[0], _lineage("g", 5))], MilesSample(index=3),
                                     expert_layers=trainer_agents.LAYERS)
    assert (kept.status, kept.remove_sample) == (Status.COMPLETED, False) and kept.metadata["lineage"]["group"] == "g"
    assert len(kept.rollout_top_p_token_offsets) == kept.response_length + 1


def test_skyrl_takes_the_support_rows_masks_the_aborted_row_and_groups_siblings(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    a, b = with_masks(sample, _lineage("g", 5)), with_masks(sample, _lineage("g", 5))
    (b,) = abort_samples([b], ENGINE_DIED)
    out = skyrl.to_generator_output([[a], [b]], [1.0, 0.0], expert_layers=trainer_agents.LAYERS)
    validated(out)
    support = out["rollout_sample_support"]
    assert support is not None and all(validate_sample_support(rows) is rows for rows in support)
    assert support[0].shape == (sample.response_length, WIDTH) and support[0].dtype == np.int32
    # SkyRL's packer (preprocess.build_sample_support): one row per response token, one width for the batch
    assert [r.shape for r in support] == [(len(ids), WIDTH) for ids in out["response_ids"]]
    assert out["stop_reasons"] == ["stop", "abort"] and set(out["loss_masks"][1]) == {0}
    assert sum(out["loss_masks"][0]) == int(sample.loss_mask.sum())
    assert out["rollout_metrics"]["infrastructure_aborts"] == 1
    assert out["trajectory_ids"] == [TrajectoryID("g", 0), TrajectoryID("g", 1)]
    assert out["rollout_metrics"]["lineage"] == [_lineage("g", 5), {**_lineage("g", 5)}]


def test_areal_rejects_the_episode_and_carries_masks_and_lineage_as_extras(episodes: Episodes, failed: object) -> None:
    workflow = areal.SessionWorkflow(episodes.stack.server, "trainer_agents.failing_agent")
    assert asyncio.run(workflow.arun_episode(None, {"messages": "x"})) is None  # AReaL's rejected trajectory
    (sample,) = episodes.tool.samples
    one = areal.to_tensor_dict([with_masks(sample, _lineage("g", 5))], reward=1.0, lineage=True)
    two = areal.to_tensor_dict(episodes.compacted.samples, reward=0.0, lineage=True)
    assert check_trajectory_format(one) and check_trajectory_format(two)
    plain = areal.to_tensor_dict(episodes.compacted.samples, reward=0.0)
    assert "lineage" not in plain and "sampling_mask_ids" not in plain
    batch = concat_padded_tensors([one, areal.to_tensor_dict([with_masks(sample)], reward=0.0, lineage=True)])
    assert len(batch["sampling_mask_ids"]) == 2 and batch["lineage"] == [_lineage("g", 5), None]
    assert batch["sampling_mask_offsets"][0].tolist() == one["sampling_mask_offsets"][0].tolist()
    assert batch["sampling_logprobs"].dtype == torch.float32 and batch["sampling_logprobs"].shape[0] == 2


def test_trl_makes_the_aborted_row_unscorable(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    out = trl.to_rollout_output([[with_masks(sample)], abort_samples([with_masks(sample)], ENGINE_DIED)],
                                [1.0, 0.0])
    assert out["rollout_reward"] == [1.0, None] and out["rollout_status"] == ["completed", "aborted"]
    assert [len(o) for o in out["sampling_mask_offsets"]] == [len(c) + 1 for c in out["completion_ids"]]
    # TRL's GRPOTrainer turns a None reward into NaN and leaves the row out of its group's baseline
    rewards = torch.tensor([float("nan") if r is None else r for r in out["rollout_reward"]])
    assert torch.isnan(rewards).tolist() == [False, True]
