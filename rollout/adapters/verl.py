"""verl 0.9: our samples as `AgentLoopOutput`s, and an agent loop that runs an episode on our server.

verl's seam (`verl/experimental/agent_loop/agent_loop.py`) is `AgentLoopBase.run(sampling_params, **kwargs) ->
AgentLoopOutput`, registered by name (`@register`) or in the agent-loop YAML (`name` + `_target_`). Field for field:

- `prompt_ids` / `response_ids`: the first turn's prompt / everything after it (later prompts, tool output, glue
  and every generated turn), so `prompt_ids + response_ids` is the sample's `tokens`;
- `response_mask`: 1 on sampled tokens, 0 on tool output and glue; `response_logprobs`: the rollout logprobs (0.0
  where the mask is 0);
- `routed_experts`: int32 [len(tokens), layers, top_k] with `expert_layers` (verl reshapes SGLang's rows the same
  way), rows the engine did not report set to 0 (verl pads missing rows with zeros, replay masks them out);
- `reward_score`: the episode's reward (verl turns it into `rm_scores` on the last response token);
- `num_turns`: the generated turns; `extra_fields`: `min_global_steps` / `max_global_steps` (the oldest and newest
  weights that sampled a token, as verl's fully-async trainer reads them), the per-token `weight_versions` and
  their counts `weight_version_tokens`, the `rollout_id` shared by every segment, the segment's provenance, a
  forked session's `lineage` (trajectory/sample_metadata.py), and with sampling masks `sampling_mask_ids` /
  `sampling_mask_offsets` / `sampling_log_probs` (slime's convention over the response: verl has no field of its own),
  and for a sample a LoRA adapter sampled `adapter_revisions`: per response token the revision that sampled it,
  `NAME@REVISION` ("" the base model, None where nothing was sampled; verl 0.9 has no field for it either, its
  `lora_request` is the server's). verl's agent loop gathers every output's `extra_fields` into `non_tensor_batch`,
  one object array per key (None where an output lacks it);
- an episode the infrastructure ended (status "aborted", trajectory/infrastructure.py): `SessionAgentLoop` raises
  `EpisodeAbortedError` (`on_abort="raise"`, the default), which verl's TransferQueue worker turns into the prompt's
  status "failure" and its replay buffer evicts the whole group (so no sibling's advantage is computed against a fake
  zero); with `on_abort="mask"` (the classic worker, which an exception would stop) the output is returned with its
  `response_mask` all 0 and the record in `extra_fields["abort"]`, as `to_agent_loop_outputs` always maps it.

A compacted or forked session is several outputs: verl's TransferQueue worker (`trainer/ppo/v1/agent_loop_tq.py`)
takes `run()`'s list and keys each `{uid}_{session_id}_{i}`; the classic worker takes one output, so
`SessionAgentLoop` returns a bare output for a one-segment session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rollout.adapters._common import (
    Agent,
    load_function,
    on_adapters,
    prompt_length,
    request_kwargs,
    require_samples,
    response_sampling_masks,
    routed_experts,
    run_session,
    token_adapter_labels,
)
from rollout.infrastructure import EpisodeAbortedError
from trajectory import Sample, parse_version, sample_metadata
from trajectory.infrastructure import ABORTED

if TYPE_CHECKING:
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput


def to_agent_loop_outputs(
    samples: Sequence[Sample],
    *,
    reward: float | None = None,
    rollout_id: Any = None,
    expert_layers: int | None = None,
    version_of: Callable[[str], int] = parse_version,
    extra_fields: dict[str, Any] | None = None,
) -> list[AgentLoopOutput]:
    """One `AgentLoopOutput` per sample (segment) of one session, every one with the episode's reward."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    outputs = []
    for index, sample in enumerate(samples):
        p = prompt_length(sample)
        experts = routed_experts(sample, expert_layers)
        if experts is not None:
            experts = experts.copy()
            experts[experts < 0] = 0
        meta = sample_metadata(sample)
        low, high = meta.version_range(version_of)
        segment = {k: sample.metadata[k] for k in ("segment", "parent", "branch_turn", "reason")
                   if k in sample.metadata}
        aborted = sample.status == ABORTED  # ended by the infrastructure: masked, nothing of it trained on
        outputs.append(AgentLoopOutput(
            prompt_ids=sample.tokens[:p].tolist(),
            response_ids=sample.tokens[p:].tolist(),
            response_mask=(sample.loss_mask[p:] * (not aborted)).astype(int).tolist(),
            response_logprobs=sample.rollout_log_probs[p:].astype(float).tolist(),
            routed_experts=experts,
            reward_score=reward,
            num_turns=int(sample.metadata.get("num_turns", 1)),
            metrics=AgentLoopMetrics(),
            extra_fields={
                "min_global_steps": low,
                "max_global_steps": high,
                "weight_versions": list(meta.token_versions[p:]),
                "rollout_id": rollout_id,
                "segment_index": index,
                "status": sample.status,
                "weight_version_tokens": meta.version_counts(),
                **({"segment": segment} if segment else {}),
                **({"lineage": sample.metadata["lineage"]} if meta.lineage is not None else {}),
                **({"adapter_revisions": token_adapter_labels(sample, p)} if on_adapters([sample]) else {}),
                **({"abort": sample.metadata.get("abort")} if aborted else {}),
                **_sampling_masks(sample),
                # verl's TransferQueue worker copies the last output's reward_extra_info onto the others whenever a
                # reward is set (and its reward loop, which would fill it, skips outputs that have one)
                **({"reward_extra_info": {}} if reward is not None else {}),
                **(extra_fields or {}),
            },
        ))
    return outputs


def _sampling_masks(sample: Sample) -> dict[str, Any]:
    """The response's sampling masks (slime's convention, rollout.adapters._common), for a top-p replay in verl's
    loss: verl has no field of its own for them."""
    support = response_sampling_masks(sample)
    if support is None:
        return {}
    ids, offsets, behaviour = support
    return {"sampling_mask_ids": ids.tolist(), "sampling_mask_offsets": offsets.tolist(),
            "sampling_log_probs": behaviour.astype(float).tolist()}


def _agent_loop_class() -> type:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase

    class SessionAgentLoop(AgentLoopBase):  # type: ignore[misc]
        """An agent loop whose episode runs against our session server (YAML: `_target_:
        rollout.adapters.verl.SessionAgentLoop`, with `servers`, `agent` (a module.function path, miles' agent
        contract), optional `max_seq_len` and `expert_layers`). verl's own server manager and tokenizer are not
        used: the session server holds the tokens."""

        def __init__(self, *args: Any, servers: str | Sequence[str], agent: str | Agent,
                     max_seq_len: int | None = None, expert_layers: int | None = None,
                     on_abort: str = "raise", **kwargs: Any) -> None:
            # AgentLoopBase.__init__ builds verl's own token builder from the trainer config; this loop needs none.
            if on_abort not in ("raise", "mask"):
                raise ValueError(f"on_abort must be 'raise' or 'mask', got {on_abort!r}")
            self.servers = [servers] if isinstance(servers, str) else list(servers)
            self.agent = load_function(agent)
            self.max_seq_len = max_seq_len
            self.expert_layers = expert_layers
            self.on_abort = on_abort
            self.verl_kwargs = kwargs

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
            from rollout.client import SessionClient

            async with SessionClient(self.servers) as client:
                episode = await run_session(
                    client, self.agent, prompt=kwargs.get("raw_prompt"), request=request_kwargs(sampling_params),
                    metadata={k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool))},
                    max_seq_len=self.max_seq_len)
            if episode.aborted and self.on_abort == "raise":
                raise EpisodeAbortedError(episode.session_id, episode.abort) from episode.failure
            require_samples(episode.samples)
            outputs = to_agent_loop_outputs(episode.samples, reward=episode.reward, rollout_id=episode.session_id,
                                            expert_layers=self.expert_layers)
            return outputs[0] if len(outputs) == 1 else outputs

    SessionAgentLoop.__module__ = __name__
    return SessionAgentLoop


def __getattr__(name: str) -> Any:
    # The class subclasses verl's AgentLoopBase, so it is built (and verl imported) on first use only.
    if name == "SessionAgentLoop":
        cls = _agent_loop_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
