"""slime: our samples as slime `Sample`s, and a custom generate function that runs the episode on our server.

slime's seam is `--custom-generate-function-path`: `async def generate(args, sample, sampling_params,
evaluation=False) -> Sample | list[Sample]`. Field for field (slime's `slime/utils/types.py`, v0.3.1), each output a
copy of the input sample (its prompt, label, index, group_index and metadata kept) with:

- `tokens`: the whole sequence; `response_length`: the tokens after the first turn's prompt;
- `loss_mask` and `rollout_log_probs`: the response part only, slime's convention (`len == response_length`), 0 on
  tool output and glue;
- `weight_versions`: one per engine call, as slime's `_apply_meta_info` appends them; the per-token spans stay in
  `metadata["weight_version_spans"]`;
- `rollout_routed_experts`: int32 [len(tokens) - 1, layers, top_k] (the tokens fed to the model, the shape slime
  reshapes SGLang's payload to with `--num-layers` and `--moe-router-topk`);
- with sampling masks (top-k / top-p sampling on a session that records them): `rollout_top_p_token_ids` and
  `rollout_top_p_token_offsets` (int32, offsets `response_length + 1`, the response part, a tool or glue token a row
  of itself), slime's sampling-support replay, and `rollout_log_probs` the engine's behaviour logprobs, each sampled
  token's over its row (what the replay's support-renormalised trainer logprobs are compared with);
- `status`: the input class's `Status` (COMPLETED / TRUNCATED / ABORTED); `reward`: the agent's reward, if any;
- an episode the infrastructure ended (status "aborted", trajectory/infrastructure.py): ABORTED with
  `remove_sample = True`, slime's own way to keep a sample in its group but out of the loss, and the failure's
  record in `metadata["abort"]`;
- `metadata`: the input's, our sample's (per-version token counts `weight_version_tokens`, a forked session's
  `lineage`: parent session, fork position, group, root, depth) and what the agent returned; for a sample a LoRA
  adapter sampled, `adapter_revisions`: one `NAME@REVISION` per engine call ("" the base model) beside
  `weight_versions` (slime's `Sample` has no field for it);
- `rollout_id`: the same on every segment of one session, so slime's loss averages within the rollout once.

`generate` reads its servers from `args.session_servers` (a list of URLs) and the agent from
`args.custom_agent_function_path` (miles' agent contract); nothing of slime is imported: the output samples are
copies of the input's own class.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout.adapters._common import (
    fed_routed_experts,
    load_function,
    on_adapters,
    prompt_length,
    request_kwargs,
    response_sampling_masks,
    run_session,
    turn_adapter_labels,
)
from trajectory import Sample, sample_metadata

_STATUS = {"completed": "COMPLETED", "truncated": "TRUNCATED", "aborted": "ABORTED"}


def to_samples(samples: Sequence[Sample], base: Any, *, reward: Any = None, rollout_id: int | None = None,
               expert_layers: int | None = None, experts_as: str = "torch", tokenizer: Any = None,
               metadata: dict[str, Any] | None = None) -> list[Any]:
    """Copies of slime/miles' input `base` sample, one per segment, filled from our samples.

    `experts_as`: "torch" (slime keeps a tensor) or "numpy" (miles' int32 array), for the routed experts and the
    sampling masks alike. `tokenizer`: decodes `response` for reward models that read text (left as the input's
    otherwise).
    """
    if rollout_id is None:
        rollout_id = base.rollout_id if base.rollout_id is not None else base.index
    out = []
    for sample in samples:
        p = prompt_length(sample)
        item = copy.deepcopy(base)
        item.tokens = sample.tokens.tolist()
        item.response_length = sample.response_length
        item.loss_mask = sample.loss_mask[p:].astype(int).tolist()
        item.rollout_log_probs = sample.rollout_log_probs[p:].astype(float).tolist()
        item.weight_versions = sample_metadata(sample).turn_versions()
        item.status = getattr(type(base).Status, _STATUS[sample.status])
        if sample.status == "aborted":  # ended by the infrastructure: slime's per-sample removal (loss mask 0)
            item.remove_sample = True
        item.reward = reward
        item.rollout_id = rollout_id
        item.metadata = {**(base.metadata or {}), **sample.metadata, **(metadata or {})}
        if on_adapters([sample]):
            item.metadata["adapter_revisions"] = turn_adapter_labels(sample)
        if tokenizer is not None:
            item.response = tokenizer.decode(sample.tokens[p:].tolist())
        if (support := response_sampling_masks(sample)) is not None:
            ids, offsets, behaviour = support
            on = sample.loss_mask[p:] == 1
            item.rollout_log_probs = np.where(on, behaviour, sample.rollout_log_probs[p:]).astype(float).tolist()
            item.rollout_top_p_token_ids, item.rollout_top_p_token_offsets = _as(ids, experts_as), _as(offsets,
                                                                                                         experts_as)
        if sample.routed_experts is not None:
            if expert_layers is None:
                raise ValueError("slime wants routed experts as [tokens, layers, top_k]: pass expert_layers")
            fed = fed_routed_experts(sample, expert_layers)
            assert fed is not None
            item.rollout_routed_experts = _as(fed, experts_as)
        out.append(item)
    return out


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> list[Any]:
    """slime's custom generate function: one session on `args.session_servers` driven by the agent at
    `args.custom_agent_function_path`; every segment a sample sharing the input's rollout id."""
    from rollout.client import SessionClient

    agent = load_function(args.custom_agent_function_path)
    max_seq_len = getattr(args, "max_seq_len", None)
    async with SessionClient(list(args.session_servers)) as client:
        episode = await run_session(client, agent, prompt=sample.prompt, request=request_kwargs(sampling_params),
                                    metadata=dict(sample.metadata or {}), max_seq_len=max_seq_len)
    if not episode.samples:
        failed = copy.deepcopy(sample)
        failed.status = type(sample).Status.ABORTED
        return [failed]
    return to_samples(episode.samples, sample, reward=episode.reward,
                      expert_layers=getattr(args, "num_layers", None) if _has_experts(episode.samples) else None,
                      metadata=episode.metadata)


def _as(array: np.ndarray, kind: str) -> Any:
    if kind == "torch":
        import torch

        return torch.from_numpy(array.copy())
    return array.copy()


def _has_experts(samples: Sequence[Sample]) -> bool:
    return any(s.routed_experts is not None for s in samples)
