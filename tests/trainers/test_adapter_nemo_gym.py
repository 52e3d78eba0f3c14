"""rollout.adapters.nemo_gym against NeMo Gym 0.7.0: a Responses-API tool episode on a live session, each call's
output items turned into NeMo Gym's `...ForTraining` models (its `training_variant_of`) with the call's token fields,
checked against the sample and against NeMo RL's rule that each call's prompt extends the previous prompt +
generation."""

from __future__ import annotations

import itertools

from nemo_gym.openai_utils import (
    NeMoGymResponseFunctionToolCallForTraining,
    NeMoGymResponseOutputMessageForTraining,
    TokenIDLogProbMixin,
)
from sample_checks import Episodes, run_episode, sampled_runs
from trainer_agents import LAYERS, OUTPUTS, SERVER_FIELDS, TOP_K, responses_agent

from rollout.adapters import nemo_gym as adapter


def test_responses_episode_items_carry_each_calls_tokens(episodes: Episodes) -> None:
    episode = run_episode(episodes.stack, responses_agent)
    (sample,) = episode.samples
    outputs = next(v for k, v in OUTPUTS.items() if episode.session_id in k)
    # the server's own return_token_ids fields on each reply are what the adapter rebuilds from the sample
    served = next(v for k, v in SERVER_FIELDS.items() if episode.session_id in k)
    assert served == adapter.call_token_fields(sample)
    items = adapter.training_outputs(sample, outputs, expert_layers=LAYERS)
    assert len(items) == 3
    assert type(items[0][-1]) is NeMoGymResponseFunctionToolCallForTraining
    assert type(items[1][-1]) is NeMoGymResponseFunctionToolCallForTraining
    assert type(items[2][-1]) is NeMoGymResponseOutputMessageForTraining
    previous: list[int] = []
    for call, (start, end) in zip(items, sampled_runs(sample), strict=True):
        last = call[-1]
        assert isinstance(last, TokenIDLogProbMixin)
        assert last.prompt_token_ids == sample.tokens[:start].tolist()
        assert last.generation_token_ids == sample.tokens[start:end].tolist()
        assert last.generation_log_probs == sample.rollout_log_probs[start:end].astype(float).tolist()
        assert last.prompt_token_ids[: len(previous)] == previous  # NeMo RL's contiguity across calls
        previous = last.prompt_token_ids + last.generation_token_ids
        assert isinstance(last.routed_experts, list)
        assert len(last.routed_experts) == end - 1 and len(last.routed_experts[0]) == LAYERS
        assert len(last.routed_experts[0][0]) == TOP_K
        assert [r for layer in last.routed_experts[-1] for r in layer] == sample.routed_experts[end - 2].tolist()
        # the other items of a call are unchanged
        for item, original in zip(call[:-1], outputs[items.index(call)][:-1], strict=True):
            assert item.model_dump(exclude_none=True)["type"] == original["type"]


def test_compacted_session_is_a_call_list_per_segment(episodes: Episodes) -> None:
    calls = [adapter.call_token_fields(s) for s in episodes.compacted.samples]
    assert [len(c) for c in calls] == [3, 2]
    for sample, segment in zip(episodes.compacted.samples, calls, strict=True):
        assert sum(len(c["generation_token_ids"]) for c in segment) == int(sample.loss_mask.sum())
        for a, b in itertools.pairwise(segment):
            assert b["prompt_token_ids"][: len(a["prompt_token_ids"]) + len(a["generation_token_ids"])] == \
                a["prompt_token_ids"] + a["generation_token_ids"]
