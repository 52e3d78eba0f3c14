"""NeMo Gym / NeMo RL: the token fields of each model call, on NeMo Gym's Responses output items.

NeMo Gym (`nemo_gym/openai_utils.py`, `TokenIDLogProbMixin`) carries a model call's tokens on the last output item
of that call, as its `...ForTraining` variant: `prompt_token_ids` (the whole prompt the engine saw),
`generation_token_ids`, `generation_log_probs` and optionally `routed_experts` ([tokens, layers, top_k] nested
lists). NeMo RL reads them back call by call and asserts that each call's prompt starts with the previous call's
prompt + generation. Field for field, per generated turn of a sample:

- `prompt_token_ids`: the sample's tokens before the turn's generation (the TITO prompt, so the previous call's
  prompt + generation is its prefix by construction); `generation_token_ids` / `generation_log_probs`: the turn's
  kept generation and its rollout logprobs (a run of mask 1);
- `routed_experts`: with `expert_layers`, the rows of the tokens fed to the model on that call (prompt +
  generation, less the last token), as SGLang returns them for the call.

NeMo Gym has no per-token weight version or reward field; a compacted or forked session is one call list per segment
(NeMo RL's prefix check holds within each). Nor has it a field for sampling masks (its models ignore unknown fields):
`call_sampling_masks` gives them per call, to keep beside the items. Nor one for a rollout to drop: a sample the
infrastructure ended (status "aborted", trajectory/infrastructure.py) is refused by `training_outputs` with
`EpisodeAbortedError`, for the caller to leave the rollout out instead of scoring it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout.adapters._common import routed_experts
from rollout.infrastructure import EpisodeAbortedError
from trajectory import Sample, infrastructure_abort, sample_metadata
from trajectory.infrastructure import ABORTED


def call_token_fields(sample: Sample, *, expert_layers: int | None = None) -> list[dict[str, Any]]:
    """One dict of NeMo Gym's token fields per engine call of `sample`, in order."""
    meta = sample_metadata(sample)
    spans, turns = meta.generations, meta.turns
    if turns and len(turns) != len(spans):
        raise ValueError(f"{len(spans)} sampled runs for {len(turns)} turns: a turn's generation is not one run")
    rows = routed_experts(sample, expert_layers) if expert_layers is not None else None
    calls = []
    for start, end in spans:
        fields: dict[str, Any] = {
            "prompt_token_ids": sample.tokens[:start].tolist(),
            "generation_token_ids": sample.tokens[start:end].tolist(),
            "generation_log_probs": sample.rollout_log_probs[start:end].astype(float).tolist(),
        }
        if rows is not None:
            fed = rows[: end - 1]
            if (fed < 0).any():
                raise ValueError(f"the call ending at {end} fed tokens without routed experts")
            fields["routed_experts"] = fed.tolist()
        calls.append(fields)
    return calls


def attach_token_fields(output: Sequence[Any], fields: dict[str, Any]) -> list[Any]:
    """A call's Responses output items (NeMo Gym models or their JSON) with `fields` on the last item, which becomes
    its ForTraining variant exactly as NeMo Gym's own converter does it (`training_variant_of`)."""
    from nemo_gym.openai_utils import NeMoGymResponseOutputItem, training_variant_of
    from pydantic import TypeAdapter

    adapter: Any = TypeAdapter(NeMoGymResponseOutputItem)
    items = [adapter.validate_python(item) if isinstance(item, dict) else item for item in output]
    if not items:
        raise ValueError("a model call with no output item has nowhere to carry its tokens")
    last = items[-1]
    train_cls = training_variant_of(type(last))
    items[-1] = train_cls(**last.model_dump(), **{k: v for k, v in fields.items() if v is not None})
    return items


def call_sampling_masks(sample: Sample) -> list[dict[str, Any]] | None:
    """Per engine call of `sample`, in order, the sampling masks of its generation: `sampling_mask_ids` and
    `sampling_mask_offsets` (CSR over the call's generated tokens) and `sampling_log_probs`. None without masks."""
    masks = sample.sampling_masks
    if masks is None:
        return None
    calls = []
    for start, end in sample_metadata(sample).generations:
        part = masks.rows(start, end)
        calls.append({"sampling_mask_ids": part.ids.tolist(), "sampling_mask_offsets": part.offsets.tolist(),
                      "sampling_log_probs": part.logprobs.astype(float).tolist()})
    return calls


def training_outputs(sample: Sample, outputs: Sequence[Sequence[Any]], *,
                     expert_layers: int | None = None) -> list[list[Any]]:
    """Every call's output items (in the order the agent made the calls) with that call's token fields attached.

    A sample the infrastructure ended is refused (EpisodeAbortedError): NeMo Gym has no field that drops it."""
    if sample.status == ABORTED:
        raise EpisodeAbortedError(None, infrastructure_abort(sample))
    calls = call_token_fields(sample, expert_layers=expert_layers)
    if len(calls) != len(outputs):
        raise ValueError(f"{len(outputs)} replies for {len(calls)} model calls in the sample")
    return [attach_token_fields(items, fields) for items, fields in zip(outputs, calls, strict=True)]
