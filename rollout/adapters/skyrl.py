"""SkyRL: our samples as a `GeneratorOutput`, and a generator that runs each prompt as a session on our server.

SkyRL's seam (`skyrl/train/generators/base.py`) is `GeneratorInterface.generate(GeneratorInput) -> GeneratorOutput`,
a TypedDict of per-row lists. Field for field, per row (one per segment of a session):

- `prompt_token_ids` / `response_ids`: the first turn's prompt / everything after it;
- `loss_masks`: 1 on sampled tokens, 0 on tool output and glue; `rollout_logprobs`: the rollout logprobs;
- `rewards`: the episode's reward (a float per row); `stop_reasons`: "stop" / "length" / "abort" from the status;
- `trajectory_ids`: the input's `TrajectoryID`, the same on every segment of one session; `is_last_step`: True on
  a session's last segment only (SkyRL's step-wise mode broadcasts the last step's advantage over the others);
- `rollout_expert_indices`: per row the routes of the tokens fed to the model, int32 [rows, layers, top_k], a prefix
  of the sequence as SkyRL's `RoutedExpertTrace.finalize` produces it (the last token is never fed).

- `rollout_sample_support`: with sampling masks, per row int32 [response tokens, width] of the ids the sampler kept,
  -1 after them and on a row the model did not sample (SkyRL's sample-support replay, `SAMPLE_SUPPORT_PADDING`);
  `width` is SkyRL's shared top-k bound (`support_width`, by default the widest row);
- an episode the infrastructure ended (status "aborted", trajectory/infrastructure.py): stop reason "abort" and its
  loss mask all 0 (SkyRL has no field to drop a row; it masks rows the same way, e.g. its overlong filtering), counted
  in `rollout_metrics["infrastructure_aborts"]`. Its reward still enters its group's baseline: a SessionGenerator
  caller who wants the group out filters on that count or on the stop reason.

Per-token weight versions have no field in SkyRL 0.4: they go in `rollout_metrics["weight_versions"]`, one list per row;
nor has the LoRA adapter revision that sampled each token (its `lora_target` is the weight sync's): when an adapter
sampled any row, `rollout_metrics["adapter_revisions"]`, one list per row, `NAME@REVISION` per response token ("" the
base model, None where nothing was sampled);
a forked session's lineage in `rollout_metrics["lineage"]` (None for a session that was not forked), and without
trajectory ids of the input, forked siblings get `TrajectoryID(instance_id=<fork group>, repetition_id=<i>)`, so
SkyRL groups them as one prompt's samples.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollout.adapters._common import (
    STOP_REASONS,
    Agent,
    fed_routed_experts,
    load_function,
    on_adapters,
    prompt_length,
    request_kwargs,
    require_samples,
    response_support_rows,
    run_session,
    token_adapter_labels,
    widest_mask_row,
)
from trajectory import Sample, sample_metadata
from trajectory.infrastructure import ABORTED

if TYPE_CHECKING:
    from skyrl.train.generators.base import GeneratorOutput, TrajectoryID


def to_generator_output(
    episodes: Sequence[Sequence[Sample]],
    rewards: Sequence[float | None],
    trajectory_ids: Sequence[TrajectoryID] | None = None,
    *,
    expert_layers: int | None = None,
    support_width: int | None = None,
) -> GeneratorOutput:
    """The rows of `episodes` (each a session's samples, one per segment) in order, with their rewards and ids.

    `support_width`: the columns of `rollout_sample_support` (SkyRL's top-k bound; by default the widest row)."""
    from skyrl.train.generators.base import GeneratorOutput, TrajectoryID

    if len(rewards) != len(episodes) or (trajectory_ids is not None and len(trajectory_ids) != len(episodes)):
        raise ValueError("give one reward (and one trajectory id) per episode")
    prompts, responses, masks, logprobs, stops, ids, last, routes, versions, rows_reward = ([] for _ in range(10))
    supports: list[Any] = []
    lineages: list[dict[str, Any] | None] = []
    with_routes = any(s.routed_experts is not None for episode in episodes for s in episode)
    all_samples = [s for episode in episodes for s in episode]
    with_masks = any(s.sampling_masks is not None for s in all_samples)
    width = support_width if support_width is not None else widest_mask_row(all_samples)
    with_adapters = on_adapters(all_samples)
    adapters: list[list[str | None]] = []
    tree_ids = trajectory_ids is None and bool(episodes) and all(
        e and sample_metadata(e[0]).lineage is not None for e in episodes)
    for e, episode in enumerate(episodes):
        for k, sample in enumerate(episode):
            p = prompt_length(sample)
            meta = sample_metadata(sample)
            aborted = sample.status == ABORTED  # ended by the infrastructure: masked out, as SkyRL masks a row
            prompts.append(sample.tokens[:p].tolist())
            responses.append(sample.tokens[p:].tolist())
            masks.append((sample.loss_mask[p:] * (not aborted)).astype(int).tolist())
            logprobs.append(sample.rollout_log_probs[p:].astype(float).tolist())
            stops.append(STOP_REASONS[sample.status])
            rows_reward.append(float(rewards[e] or 0.0))
            last.append(k == len(episode) - 1)
            versions.append(list(meta.token_versions[p:]))
            if with_adapters:
                adapters.append(token_adapter_labels(sample, p))
            lineages.append(sample.metadata.get("lineage"))
            if trajectory_ids is not None:
                ids.append(trajectory_ids[e])
            elif tree_ids and meta.lineage is not None:  # forked siblings: one instance, one repetition each
                ids.append(TrajectoryID(instance_id=meta.lineage.group, repetition_id=_sibling(episodes, e)))
            if with_masks:
                rows = response_support_rows(sample, width)
                if rows is None:
                    raise ValueError(f"episode {e} segment {k} has no sampling masks while others do")
                supports.append(rows)
            if with_routes:
                if expert_layers is None:
                    raise ValueError("SkyRL wants routes as [tokens, layers, top_k]: pass expert_layers")
                fed = fed_routed_experts(sample, expert_layers)
                if fed is None:
                    raise ValueError(f"episode {e} segment {k} has no routed experts while others do")
                routes.append(fed)
    return GeneratorOutput(
        prompt_token_ids=prompts,
        response_ids=responses,
        rewards=rows_reward,
        loss_masks=masks,
        stop_reasons=stops,
        rollout_metrics={"weight_versions": versions, "lineage": lineages,
                         "infrastructure_aborts": sum(s.status == ABORTED for s in all_samples),
                         **({"adapter_revisions": adapters} if with_adapters else {})},
        rollout_logprobs=logprobs,
        trajectory_ids=ids if trajectory_ids is not None or tree_ids else None,
        trajectory_generation_times=None,
        trajectory_time_splits=None,
        rollout_expert_indices=routes if with_routes else None,
        rollout_sample_support=supports if with_masks else None,
        is_last_step=last,
        env_metrics=None,
        pixel_values=None,
        image_grid_thw=None,
    )


def _sibling(episodes: Sequence[Sequence[Sample]], e: int) -> int:
    """Episode `e`'s place among the episodes of its fork group, in order."""
    group = sample_metadata(episodes[e][0]).lineage
    assert group is not None
    return sum(1 for other in episodes[:e]
               if other and (lineage := sample_metadata(other[0]).lineage) is not None and lineage.group == group.group)


def _generator_class() -> type:
    from skyrl.train.generators.base import GeneratorInterface

    class SessionGenerator(GeneratorInterface):  # type: ignore[misc]
        """Runs every prompt of the batch as one session on our servers (the agent follows miles' contract: it gets
        the session's OpenAI base URL, the prompt, the request fields and the env extras as metadata)."""

        def __init__(self, servers: str | Sequence[str], agent: str | Agent, *, max_seq_len: int | None = None,
                     expert_layers: int | None = None, concurrency: int = 64) -> None:
            self.servers = [servers] if isinstance(servers, str) else list(servers)
            self.agent = load_function(agent)
            self.max_seq_len = max_seq_len
            self.expert_layers = expert_layers
            self.concurrency = concurrency

        async def generate(self, input_batch: Any) -> Any:
            from rollout.client import SessionClient

            prompts = input_batch["prompts"]
            extras = input_batch.get("env_extras") or [{} for _ in prompts]
            request = request_kwargs(input_batch.get("sampling_params"))
            gate = asyncio.Semaphore(self.concurrency)
            async with SessionClient(self.servers) as client:
                async def one(prompt: Any, extra: dict[str, Any]) -> Any:
                    async with gate:
                        return await run_session(client, self.agent, prompt=prompt, request=request,
                                                 metadata=dict(extra or {}), max_seq_len=self.max_seq_len)

                episodes = await asyncio.gather(*(one(p, x) for p, x in zip(prompts, extras, strict=True)))
            for episode in episodes:
                require_samples(episode.samples)
            return to_generator_output([e.samples for e in episodes], [e.reward for e in episodes],
                                       input_batch.get("trajectory_ids"), expert_layers=self.expert_layers)

    SessionGenerator.__module__ = __name__
    return SessionGenerator


def __getattr__(name: str) -> Any:
    if name == "SessionGenerator":
        cls = _generator_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
