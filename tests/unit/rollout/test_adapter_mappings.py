"""The adapters' mappings that need no trainer installed (the trainers tier checks the rest against the real
classes): an episode the infrastructure ended, sampling masks and fork lineage, field for field."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from rollout.adapters import nemo_gym, trl
from rollout.adapters._common import (
    on_adapters,
    response_support_rows,
    run_session,
    token_adapter_labels,
    turn_adapter_labels,
    widest_mask_row,
)
from rollout.adapters.slime import to_samples
from rollout.infrastructure import EpisodeAbortedError
from support.slime_sample import SlimeSample, Status
from trajectory import InfrastructureAbort, Sample, abort_samples, infrastructure_abort

LINEAGE = {"parent_session": "p", "fork_position": 2, "fork_turns": 0, "group": "g1", "root_session": "p", "depth": 1}
ENGINE_DIED = InfrastructureAbort("engine_unavailable", "engine_unavailable", 502, "gone", 2, "server")


def sample(*, masks: bool = True, lineage: bool = False, adapters: list[Any] | None = None) -> Sample:
    """Prompt [1, 2], reply [7, 8] (rows [7, 3] and [8]), tool output [4], reply [9] (row [5, 9, 6]); `adapters`: the
    LoRA adapter revision of each turn, as the session server writes them."""
    extra: dict[str, Any] = {"lineage": dict(LINEAGE)} if lineage else {}
    if adapters is not None:
        extra["adapters"] = adapters
    return Sample(tokens=np.array([1, 2, 7, 8, 4, 9], np.int32), loss_mask=np.array([0, 0, 1, 1, 0, 1], np.uint8),
                  rollout_log_probs=np.array([0, 0, -3, -4, 0, -5], np.float32), response_length=4,
                  status="completed", metadata={"num_turns": 2, "turns": [[2, 2], [5, 1]],
                                                "weight_version_spans": [["3", 2, 4], ["4", 5, 6]], **extra},
                  **({"sampling_mask_ids": np.array([7, 3, 8, 5, 9, 6], np.int32),
                      "sampling_mask_offsets": np.array([0, 0, 0, 2, 3, 3, 6], np.int64),
                      "sampling_log_probs": np.array([0, 0, -0.5, 0, 0, -1.5], np.float32)} if masks else {}))


def aborted(s: Sample) -> Sample:
    (out,) = abort_samples([s], ENGINE_DIED)
    return out


# -- _common ------------------------------------------------------------------------------------------------------

def test_dense_support_rows_pad_with_minus_one_and_leave_unsampled_tokens_empty() -> None:
    rows = response_support_rows(sample(), 3)
    assert rows is not None and rows.dtype == np.int32
    assert rows.tolist() == [[7, 3, -1], [8, -1, -1], [-1, -1, -1], [5, 9, 6]]  # reply, reply, tool output, reply
    assert widest_mask_row([sample(), sample(masks=False)]) == 3
    assert response_support_rows(sample(masks=False), 3) is None
    with pytest.raises(ValueError, match="wider than 2"):
        response_support_rows(sample(), 2)


def test_adapter_labels_name_each_tokens_revision_and_the_base_model_by_an_empty_string() -> None:
    lora = sample(adapters=[["policy", "0"], ["policy", "3"]])
    assert token_adapter_labels(lora, 2) == ["policy@0", "policy@0", None, "policy@3"]  # the tool output: None
    assert token_adapter_labels(lora)[:2] == [None, None]  # the prompt
    assert turn_adapter_labels(lora) == ["policy@0", "policy@3"]
    mixed = sample(adapters=[None, ["policy", "3"]])  # the first turn on the base model, the second on the adapter
    assert token_adapter_labels(mixed, 2) == ["", "", None, "policy@3"]
    assert on_adapters([sample(), mixed]) and not on_adapters([sample(), sample(adapters=[None, None])])


# -- slime / miles ------------------------------------------------------------------------------------------------

def test_slime_carries_each_engine_calls_adapter_revision_in_the_metadata() -> None:
    lora, plain = to_samples([sample(adapters=[["policy", "2"], ["policy", "3"]]), sample()], SlimeSample(),
                             experts_as="numpy")
    assert lora.metadata["adapter_revisions"] == ["policy@2", "policy@3"]
    assert len(lora.weight_versions) == 2 and "adapter_revisions" not in plain.metadata  # one of each per call



def test_slime_removes_a_sample_the_infrastructure_ended_and_keeps_the_lineage() -> None:
    kept, dropped = to_samples([sample(lineage=True), aborted(sample(lineage=True))], SlimeSample(),
                               experts_as="numpy")
    assert (kept.status, kept.remove_sample) == (Status.COMPLETED, False)
    assert (dropped.status, dropped.remove_sample) == (Status.ABORTED, True)
    assert dropped.metadata["abort"] == ENGINE_DIED.info() and "abort" not in kept.metadata
    assert kept.metadata["lineage"] == dropped.metadata["lineage"] == LINEAGE
    assert kept.loss_mask == dropped.loss_mask  # slime zeroes a removed sample's loss itself


# -- TRL ----------------------------------------------------------------------------------------------------------

def test_trl_rows_an_infrastructure_abort_as_unscorable_and_carries_masks_and_lineage() -> None:
    out = trl.to_rollout_output([[sample(lineage=True)], [aborted(sample())]], [1.0, 0.0])
    assert out["rollout_reward"] == [1.0, None] and out["rollout_status"] == ["completed", "aborted"]
    # CSR over the completion [7, 8, 4, 9]: the tool token's row empty
    assert out["sampling_mask_ids"] == [[7, 3, 8, 5, 9, 6]] * 2
    assert out["sampling_mask_offsets"] == [[0, 2, 3, 3, 6]] * 2
    assert out["sampling_logprobs"] == [[-0.5, 0.0, 0.0, -1.5]] * 2
    assert out["lineage"] == [LINEAGE, None]
    plain = trl.to_rollout_output([[sample(masks=False)]], [1.0])
    assert "sampling_mask_ids" not in plain and "lineage" not in plain and "adapter_revisions" not in plain
    with pytest.raises(ValueError, match="no sampling masks while others do"):
        trl.to_rollout_output([[sample()], [sample(masks=False)]])


def test_trl_rows_carry_the_adapter_revision_of_each_completion_token_once_any_episode_has_one() -> None:
    out = trl.to_rollout_output([[sample(adapters=[["policy", "2"], ["policy", "3"]])], [sample()]], [1.0, 0.0])
    assert out["adapter_revisions"] == [["policy@2", "policy@2", None, "policy@3"], ["", "", None, ""]]
    assert out["weight_versions"][0] == ["3", "3", None, "4"]


# -- NeMo Gym -----------------------------------------------------------------------------------------------------

def test_nemo_gym_masks_per_call_and_no_training_items_for_an_aborted_sample() -> None:
    calls = nemo_gym.call_sampling_masks(sample())
    assert calls == [
        {"sampling_mask_ids": [7, 3, 8], "sampling_mask_offsets": [0, 2, 3], "sampling_log_probs": [-0.5, 0.0]},
        {"sampling_mask_ids": [5, 9, 6], "sampling_mask_offsets": [0, 3], "sampling_log_probs": [-1.5]},
    ]
    assert nemo_gym.call_sampling_masks(sample(masks=False)) is None
    with pytest.raises(EpisodeAbortedError, match="engine_unavailable") as raised:
        nemo_gym.training_outputs(aborted(sample()), [[], []])
    assert raised.value.abort == ENGINE_DIED


# -- run_session: the agent's side ------------------------------------------------------------------------------

class FakeClient:
    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.deleted: list[str] = []

    @contextlib.asynccontextmanager
    async def session(self, metadata: dict[str, Any] | None = None) -> AsyncIterator[str]:
        try:
            yield "s1"
        finally:
            self.deleted.append("s1")

    def base_url(self, sid: str) -> str:
        return f"http://server/sessions/{sid}/v1"

    async def collect(self, sid: str, max_seq_len: int | None = None, format: str = "safetensors") -> list[Sample]:
        return self.samples


def _run(client: FakeClient, agent: Any) -> Any:
    return asyncio.run(run_session(client, agent))  # type: ignore[arg-type]


def test_an_agent_failed_by_the_infrastructure_gives_an_aborted_episode_without_reward() -> None:
    async def agent(**_: Any) -> float:
        raise openai.APIConnectionError(request=httpx.Request("POST", "http://server"))

    client = FakeClient([sample()])
    episode = _run(client, agent)
    assert episode.aborted and episode.reward is None and isinstance(episode.failure, openai.APIConnectionError)
    assert episode.abort is not None and episode.abort.cause == "connection"
    assert [infrastructure_abort(s) is not None for s in episode.samples] == [True]
    assert client.deleted == ["s1"]


def test_an_agents_own_failure_propagates_and_a_server_record_marks_a_returned_episode() -> None:
    async def buggy(**_: Any) -> float:
        raise ValueError("a bug in the agent")

    with pytest.raises(ValueError, match="a bug"):
        _run(FakeClient([sample()]), buggy)

    async def swallowing(**_: Any) -> float:
        return 0.0  # an agent that caught the 5xx and scored the episode zero: the server's record says otherwise

    episode = _run(FakeClient([aborted(sample())]), swallowing)
    assert episode.aborted and episode.abort == ENGINE_DIED and episode.reward == 0.0
    assert not _run(FakeClient([sample()]), swallowing).aborted
