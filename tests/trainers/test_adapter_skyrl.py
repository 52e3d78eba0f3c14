"""rollout.adapters.skyrl against SkyRL 0.4.0: real samples into SkyRL's `GeneratorOutput` (validated against the
TypedDict's own annotations with pydantic), routes through SkyRL's own `compact_routed_expert_indices`, and
`SessionGenerator.generate` on a live session with a real `GeneratorInput` and `TrajectoryID`s."""

from __future__ import annotations

import asyncio
import typing
from typing import Any

import numpy as np
import trainer_agents
from sample_checks import (
    Episodes,
    assert_split,
    assert_tool_sample,
    expected_adapter_labels,
    expected_token_versions,
)
from skyrl.backends.skyrl_train.utils.routed_experts import compact_routed_expert_indices
from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput, TrajectoryID
from trainer_agents import LAYERS, TOP_K

from rollout.adapters import skyrl as adapter
from trajectory import truncate_sample


def of_type(value: Any, hint: Any) -> bool:
    """isinstance for the annotations SkyRL's TypedDict uses (pydantic refuses typing.TypedDict on Python 3.11)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is typing.Union:
        return any(of_type(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(of_type(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(of_type(k, args[0]) and of_type(v, args[1]) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, float)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def validated(out: Any) -> None:
    """Every key of SkyRL's TypedDict present, every value of its annotated type."""
    hints = typing.get_type_hints(GeneratorOutput)
    assert set(out) == set(hints)
    for key, hint in hints.items():
        assert of_type(out[key], hint), (key, hint, type(out[key]))


def test_tool_and_compacted_episodes_field_for_field(episodes: Episodes) -> None:
    (tool,) = episodes.tool.samples
    assert_tool_sample(tool)
    ids = [TrajectoryID("task-a", 0), TrajectoryID("task-b", 1)]
    out = adapter.to_generator_output([episodes.tool.samples, episodes.compacted.samples],
                                      [episodes.tool.reward, episodes.compacted.reward], ids, expert_layers=LAYERS)
    validated(out)
    rows = [tool, *episodes.compacted.samples]
    assert len(out["response_ids"]) == 3
    for i, sample in enumerate(rows):
        assert_split(sample, out["prompt_token_ids"][i], out["response_ids"][i], out["loss_masks"][i],
                     out["rollout_logprobs"][i])
        p = len(out["prompt_token_ids"][i])
        assert out["rollout_metrics"]["weight_versions"][i] == expected_token_versions(sample)[p:]
        routes = out["rollout_expert_indices"][i]
        assert routes.shape == (len(sample.tokens) - 1, LAYERS, TOP_K)
        assert np.array_equal(routes.reshape(len(routes), -1), sample.routed_experts[:-1])
        assert np.array_equal(compact_routed_expert_indices(routes), routes)
    assert out["rewards"] == [trainer_agents.REWARD] * 3
    assert out["trajectory_ids"] == [ids[0], ids[1], ids[1]]  # both segments of the compacted session share its id
    assert out["is_last_step"] == [True, False, True]
    assert out["stop_reasons"] == ["stop"] * 3


def test_adapter_revisions_go_in_rollout_metrics_one_list_per_row(episodes: Episodes) -> None:
    (lora,) = episodes.lora.samples
    out = adapter.to_generator_output([episodes.lora.samples, episodes.compacted.samples], [1.0, 0.0],
                                      expert_layers=LAYERS)
    validated(out)
    rows = [lora, *episodes.compacted.samples]
    revisions = out["rollout_metrics"]["adapter_revisions"]
    assert len(revisions) == 3 and {x for x in revisions[0] if x is not None} == {"a1@0"}
    for i, sample in enumerate(rows):
        assert revisions[i] == expected_adapter_labels(sample)[len(out["prompt_token_ids"][i]):]  # "" on the base's
    plain = adapter.to_generator_output([episodes.tool.samples], [1.0], expert_layers=LAYERS)
    assert "adapter_revisions" not in plain["rollout_metrics"]


def test_session_generator_runs_a_batch(episodes: Episodes) -> None:
    cls = adapter.SessionGenerator
    assert issubclass(cls, GeneratorInterface)
    generator = cls(episodes.stack.server, "trainer_agents.compacting_agent", expert_layers=LAYERS)
    ids = [TrajectoryID("t", 0), TrajectoryID("t", 1)]
    batch = GeneratorInput(prompts=[[{"role": "user", "content": "fix it"}]] * 2, env_classes=["x", "x"],
                           env_extras=[{"task": 1}, {"task": 2}], sampling_params={"max_new_tokens": 256},
                           trajectory_ids=ids, batch_metadata=None)
    out = asyncio.run(generator.generate(batch))
    validated(out)
    assert out["trajectory_ids"] == [ids[0], ids[0], ids[1], ids[1]]
    assert out["is_last_step"] == [False, True, False, True]
    assert out["rewards"] == [trainer_agents.REWARD] * 4


def test_a_truncated_sample_is_a_length_stop_with_its_versions_cut(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    cut = truncate_sample(sample, len(sample.tokens) - 3)  # what the server does for max_seq_len: inside the last reply
    assert cut.status == "truncated" and len(cut.tokens) == len(sample.tokens) - 3
    out = adapter.to_generator_output([[cut]], [1.0], expert_layers=LAYERS)
    validated(out)
    assert out["stop_reasons"] == ["length"]
    assert_split(cut, out["prompt_token_ids"][0], out["response_ids"][0], out["loss_masks"][0],
                 out["rollout_logprobs"][0])
    p = len(out["prompt_token_ids"][0])
    assert out["rollout_metrics"]["weight_versions"][0] == expected_token_versions(sample)[p:len(cut.tokens)]
    assert out["rollout_expert_indices"][0].shape == (len(cut.tokens) - 1, LAYERS, TOP_K)
