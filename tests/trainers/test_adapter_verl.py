"""rollout.adapters.verl against verl 0.9.1: real samples into verl's own `AgentLoopOutput` (pydantic), its
`as_dict()` (what verl's TransferQueue worker stores), and `SessionAgentLoop.run` on a live session."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import torch
import trainer_agents
import verl.experimental.agent_loop.agent_loop as verl_loop
from sample_checks import (
    Episodes,
    assert_split,
    assert_tool_sample,
    expected_adapter_labels,
    expected_token_versions,
)
from trainer_agents import LAYERS, TOP_K

from rollout.adapters import verl as adapter


def test_tool_episode_field_for_field(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    assert_tool_sample(sample)
    (out,) = adapter.to_agent_loop_outputs(episodes.tool.samples, reward=episodes.tool.reward, rollout_id="r1",
                                           expert_layers=LAYERS)
    assert type(out) is verl_loop.AgentLoopOutput
    assert_split(sample, out.prompt_ids, out.response_ids, out.response_mask, out.response_logprobs)
    assert out.reward_score == trainer_agents.REWARD and out.num_turns == 3
    p = len(out.prompt_ids)
    assert out.extra_fields["weight_versions"] == expected_token_versions(sample)[p:]
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (5, 7)
    assert out.extra_fields["rollout_id"] == "r1"
    experts = np.asarray(out.routed_experts)
    assert experts.shape == (len(sample.tokens), LAYERS, TOP_K)
    assert np.array_equal(experts[:-1].reshape(len(sample.tokens) - 1, -1), sample.routed_experts[:-1])
    assert (experts[-1] == 0).all()  # the unreported last row, zero as verl pads it

    # verl's own conversion to the tensors it trains on
    d = out.as_dict()
    assert torch.equal(d["prompts"], torch.tensor(sample.tokens[:p].tolist()))
    assert torch.equal(d["response_mask"], torch.tensor(sample.loss_mask[p:].tolist()))
    assert torch.allclose(d["rollout_log_probs"], torch.from_numpy(sample.rollout_log_probs[p:]))
    assert d["routed_experts"].shape == (len(sample.tokens), LAYERS, TOP_K)
    assert d["rm_scores"][-1] == trainer_agents.REWARD and d["rm_scores"][:-1].abs().sum() == 0


def test_an_adapter_sampled_output_reaches_verls_non_tensor_batch_with_its_revisions(episodes: Episodes) -> None:
    (lora,), (base,) = episodes.lora.samples, episodes.tool.samples
    (with_adapter,) = adapter.to_agent_loop_outputs([lora], reward=1.0, rollout_id="r3")
    (without,) = adapter.to_agent_loop_outputs([base], reward=0.0, rollout_id="r4")
    p = len(with_adapter.prompt_ids)
    assert with_adapter.extra_fields["adapter_revisions"] == expected_adapter_labels(lora)[p:]
    assert "adapter_revisions" not in without.extra_fields
    # verl's own batching (AgentLoopWorker._postprocess): every output's extra_fields into non_tensor_batch
    batch = verl_loop.AgentLoopWorker._postprocess(SimpleNamespace(reward_loop_worker_handles=None),
                                                   [_padded(with_adapter), _padded(without)])
    revisions = batch.non_tensor_batch["adapter_revisions"]
    assert revisions[0] == expected_adapter_labels(lora)[p:] and revisions[1] is None


def _padded(out: verl_loop.AgentLoopOutput, prompt: int = 64, response: int = 64) -> verl_loop._InternalAgentLoopOutput:
    """`out` padded as verl's agent loop worker pads it (the prompt on the left, the response on the right)."""
    def pad(ids: list[int], width: int, left: bool) -> torch.Tensor:
        fill = [0] * (width - len(ids))
        return torch.tensor([fill + ids if left else ids + fill])

    prompt_ids, response_ids = pad(out.prompt_ids, prompt, True), pad(out.response_ids, response, False)
    attention = torch.cat([pad([1] * len(out.prompt_ids), prompt, True), pad([1] * len(out.response_ids), response,
                                                                              False)], dim=1)
    return verl_loop._InternalAgentLoopOutput(
        prompt_ids=prompt_ids, response_ids=response_ids, input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0), response_mask=pad(out.response_mask, response, False),
        attention_mask=attention, reward_score=out.reward_score, num_turns=out.num_turns, metrics=out.metrics,
        extra_fields=dict(out.extra_fields))


def test_compacted_session_is_one_output_per_segment_sharing_the_rollout_id(episodes: Episodes) -> None:
    samples = episodes.compacted.samples
    outs = adapter.to_agent_loop_outputs(samples, reward=episodes.compacted.reward, rollout_id="r2",
                                         expert_layers=LAYERS)
    assert len(outs) == 2
    for sample, out in zip(samples, outs, strict=True):
        assert_split(sample, out.prompt_ids, out.response_ids, out.response_mask, out.response_logprobs)
        assert out.extra_fields["rollout_id"] == "r2" and out.reward_score == trainer_agents.REWARD
    assert [o.extra_fields["segment"]["segment"] for o in outs] == [0, 1]
    assert all(o.extra_fields["reward_extra_info"] == {} for o in outs)  # what verl's TQ worker copies across
    assert outs[1].extra_fields["segment"]["parent"] == 0 and outs[1].num_turns == 2


def test_session_agent_loop_runs_an_episode(episodes: Episodes) -> None:
    cls = adapter.SessionAgentLoop
    assert issubclass(cls, verl_loop.AgentLoopBase)
    loop = cls(servers=episodes.stack.server, agent="trainer_agents.compacting_agent", expert_layers=LAYERS)
    outs = asyncio.run(loop.run({"temperature": 1.0, "top_p": 1.0, "logprobs": True}, raw_prompt="fix it"))
    assert isinstance(outs, list) and len(outs) == 2
    assert all(type(o) is verl_loop.AgentLoopOutput for o in outs)
    assert len({o.extra_fields["rollout_id"] for o in outs}) == 1
    assert all(o.reward_score == trainer_agents.REWARD for o in outs)
    single = asyncio.run(cls(servers=[episodes.stack.server], agent=trainer_agents.tool_agent).run({}, raw_prompt="x"))
    assert type(single) is verl_loop.AgentLoopOutput and single.num_turns == 3
    assert (single.extra_fields["min_global_steps"], single.extra_fields["max_global_steps"]) == (5, 7)


def test_session_agent_loop_from_verl_yaml(episodes: Episodes) -> None:
    """The loop as verl builds it from agent_loop.yaml: OmegaConf entries, hydra.utils.instantiate, verl's kwargs."""
    import hydra
    from omegaconf import OmegaConf

    (entry,) = OmegaConf.create([{"name": "session", "_target_": "rollout.adapters.verl.SessionAgentLoop",
                                  "servers": [episodes.stack.server], "agent": "trainer_agents.tool_agent",
                                  "expert_layers": LAYERS}])
    loop = hydra.utils.instantiate(config=entry, trainer_config=None, server_manager=None, tokenizer=None,
                                   processor=None, hf_model_type=None, dataset_cls=None, data_config=None, tools=None)
    out = asyncio.run(loop.run({"temperature": 1.0}, raw_prompt="fix it"))
    assert type(out) is verl_loop.AgentLoopOutput
    assert np.asarray(out.routed_experts).shape == (len(out.prompt_ids) + len(out.response_ids), LAYERS, TOP_K)
