"""TRL: a `GRPOTrainer(rollout_func=...)` that runs each prompt as a session on our server, weights pushed into SGLang.

TRL's seam (`trl/trainer/grpo_trainer.py`, `RolloutFunc = Callable[[list, GRPOTrainer], dict]`) calls the function
with the process's prompts (already repeated `num_generations` times by TRL's `RepeatSampler`) and wants one
completion per prompt: `prompt_ids`, `completion_ids`, `logprobs` (one float per completion token), optionally
`env_mask` (1 on model tokens, 0 on environment tokens, which TRL uses as its tool mask); any other key reaches the
reward functions as a keyword. Field for field:

- `prompt_ids` / `completion_ids`: the first turn's prompt / everything after it (later turns, tool output, glue);
- `logprobs`: the rollout logprobs of the completion (0.0 on tool output); `env_mask`: the sample's loss mask there;
- `rollout_reward`: the agent's reward per completion (a reward function may return it); `weight_versions`: the
  version that sampled each completion token (None on tool output); `rollout_status`: the sample's status;
- an episode the infrastructure ended (status "aborted", trajectory/infrastructure.py): `rollout_reward` None, so a
  reward function that returns it makes the completion TRL's "unscorable" one (every reward None: NaN, left out of
  its group's baseline, advantage 0) instead of a fake zero;
- with sampling masks (TRL 1.16 has no field for them: extras, which reach the reward functions as keywords):
  `sampling_mask_ids` / `sampling_mask_offsets` (CSR over the completion, empty rows on tool output) and
  `sampling_logprobs`; a forked session's `lineage` (None for the others) when any episode has one;
- `adapter_revisions` when a LoRA adapter sampled any episode (TRL 1.16 has no field for it: an extra): per
  completion token the revision that sampled it, `NAME@REVISION` ("" the base model, None on tool output), beside
  `weight_versions`.

TRL pushes new weights only into its own vLLM. With `engine_url`, the rollout function pushes them into SGLang
before each rollout whose `trainer.state.global_step` is new, through rollout.weight_push (every session server
paused in place, `update_weights_from_disk` under the step's version, continued), so tokens carry the step that
sampled them. A TRL row is one prompt's completion: a compacted or forked session (several samples) is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import tempfile
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from rollout.adapters._common import (
    Agent,
    load_function,
    on_adapters,
    prompt_length,
    request_kwargs,
    run_session,
    token_adapter_labels,
)
from trajectory import Sample, sample_metadata
from trajectory.infrastructure import ABORTED

RolloutFunc = Callable[[list[Any], Any], dict[str, Any]]


def to_rollout_output(episodes: Sequence[Sequence[Sample]],
                      rewards: Sequence[float | None] | None = None) -> dict[str, Any]:
    """TRL's rollout dict, one row per episode (each episode exactly one sample)."""
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                                 "weight_versions": [], "rollout_status": []}
    with_masks = any(s.sampling_masks is not None for episode in episodes for s in episode)
    with_lineage = any("lineage" in s.metadata for episode in episodes for s in episode)
    with_adapters = on_adapters([s for episode in episodes for s in episode])
    for e, episode in enumerate(episodes):
        if len(episode) != 1:
            raise ValueError(f"episode {e} has {len(episode)} samples: a TRL row is one completion of one prompt, "
                             "so a compacted or forked session cannot be one")
        (sample,) = episode
        p = prompt_length(sample)
        out["prompt_ids"].append(sample.tokens[:p].tolist())
        out["completion_ids"].append(sample.tokens[p:].tolist())
        out["logprobs"].append(sample.rollout_log_probs[p:].astype(float).tolist())
        out["env_mask"].append(sample.loss_mask[p:].astype(int).tolist())
        out["weight_versions"].append(list(sample_metadata(sample).token_versions[p:]))
        out["rollout_status"].append(sample.status)
        if with_masks:
            masks = sample.sampling_masks
            if masks is None:
                raise ValueError(f"episode {e} has no sampling masks while others do")
            part = masks.rows(p, len(sample.tokens))
            out.setdefault("sampling_mask_ids", []).append(part.ids.tolist())
            out.setdefault("sampling_mask_offsets", []).append(part.offsets.tolist())
            out.setdefault("sampling_logprobs", []).append(part.logprobs.astype(float).tolist())
        if with_lineage:
            out.setdefault("lineage", []).append(sample.metadata.get("lineage"))
        if with_adapters:
            out.setdefault("adapter_revisions", []).append(token_adapter_labels(sample, p))
    if rewards is not None:
        # an episode the infrastructure ended scores None: TRL's unscorable completion (NaN reward, out of its
        # group's baseline, advantage 0) once a reward function returns it
        out["rollout_reward"] = [None if episode[0].status == ABORTED else reward
                                 for episode, reward in zip(episodes, rewards, strict=True)]
    return out


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` from TRL's synchronous call (in a worker thread if this thread already runs a loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def make_rollout_func(servers: str | Sequence[str], agent: str | Agent, *, max_seq_len: int | None = None,
                      sampling_params: dict[str, Any] | None = None, engine_url: str | None = None,
                      checkpoint_dir: str | Path | None = None, admin_token: str | None = None,
                      concurrency: int = 64) -> RolloutFunc:
    """A `rollout_func` for `GRPOTrainer`: each prompt one session driven by `agent` (miles' agent contract).

    With `engine_url`, the trainer's model is saved (`save_pretrained`) under `checkpoint_dir` (a temporary
    directory by default) and pushed into that SGLang engine whenever the global step moved since the last push.
    """
    urls = [servers] if isinstance(servers, str) else list(servers)
    run_agent = load_function(agent)
    request = request_kwargs(sampling_params)
    pushed = {"step": 0}  # the engine starts on the weights the trainer starts from
    root = Path(checkpoint_dir) if checkpoint_dir is not None else Path(tempfile.mkdtemp(prefix="trl-weights-"))

    async def push(trainer: Any, step: int) -> None:
        from rollout.weight_push import WeightPusher, save_weights

        accelerator = getattr(trainer, "accelerator", None)
        model = accelerator.unwrap_model(trainer.model) if accelerator is not None else trainer.model
        path = save_weights(model, root / f"step-{step}")
        assert engine_url is not None
        async with WeightPusher(engine_url, urls, admin_token=admin_token) as pusher:
            await pusher.push(path, str(step))

    async def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        from rollout.client import SessionClient

        step = int(trainer.state.global_step)
        if engine_url is not None and step != pushed["step"]:
            await push(trainer, step)
            pushed["step"] = step
        gate = asyncio.Semaphore(concurrency)
        async with SessionClient(urls) as client:
            async def one(prompt: Any) -> Any:
                async with gate:
                    return await run_session(client, run_agent, prompt=prompt, request=request,
                                             max_seq_len=max_seq_len)

            episodes = await asyncio.gather(*(one(p) for p in prompts))
        return to_rollout_output([e.samples for e in episodes], [e.reward for e in episodes])

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        result: dict[str, Any] = _run(rollout(prompts, trainer))
        return result

    return rollout_func
