"""The trainer's step: check every sampled token against the weights of its version, bound staleness at collection,
take clipped policy-gradient steps with truncated importance sampling, push the weights in place."""

from __future__ import annotations

import asyncio
import copy
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.demo_rl.game import Reward
from examples.demo_rl.policy import TEMPERATURE, AlphabetPolicy
from examples.demo_rl.rollouts import Group
from examples.demo_rl.step_record import StepRecord
from examples.demo_rl.truncation import batch_masks, rows_of, support_figures
from rollout.grpo import StalenessReport, clipped_pg_loss, filter_stale, group_advantages, truncated_is_weights
from rollout.logprob_check import check_logprobs
from rollout.torch_batch import to_torch_batch
from rollout.weight_push import WeightPusher, save_weights
from trajectory import Sample
from trajectory.sample_metadata import AdapterRevision


def cache_hit_rate(samples: list[Sample]) -> float:
    """Prompt tokens the engine's prefix cache served over all prompt tokens, every turn of `samples` (the engine's
    `cached_tokens`); nan when there were none."""
    cached = prompt = 0
    for sample in samples:
        turns = sample.metadata.get("turns") or []
        cached += sum(sample.metadata.get("cached_tokens") or [])
        prompt += sum(int(t[0]) for t in turns)
    return cached / prompt if prompt else math.nan


def straddled_mask(sample: Sample) -> np.ndarray:
    """Sampled tokens of a reply that started under older weights than theirs: each turn's completion is one engine
    request (continued requests aside) whose KV its first version computed."""
    out = np.zeros(len(sample.tokens), dtype=bool)
    spans = sample.metadata.get("weight_version_spans") or []
    for prompt_len, completion_len in sample.metadata.get("turns", []):
        end = prompt_len + completion_len
        first: str | None = None
        for version, a, b in spans:
            if b <= prompt_len or a >= end:
                continue
            if first is None:
                first = version
            elif version != first:
                out[max(a, prompt_len):min(b, end)] = True
    return out & sample.loss_mask.astype(bool)


def _straddled_turns(sample: Sample) -> int:
    """Turns of `sample` whose reply holds tokens of more than one weight version."""
    spans = sample.metadata.get("weight_version_spans") or []
    count = 0
    for prompt_len, completion_len in sample.metadata.get("turns", []):
        versions = {v for v, a, b in spans if a < prompt_len + completion_len and b > prompt_len}
        count += len(versions) > 1
    return count


class Trainer:
    """The policy, its optimizer, the weights of the versions samples may still carry, and the push."""

    def __init__(self, policy: AlphabetPolicy, *, lr: float, body_lr: float, clip: float, is_cap: float,
                 minibatches: int, max_staleness: int, weights_dir: Path, pusher: WeightPusher, reward: Reward,
                 flush_cache: bool = False, support: bool = False) -> None:
        self.policy = policy
        self.support = support  # sampled with top-k / top-p: support-normalised ratios (truncation.py)
        self.reward = reward
        self.flush_cache = flush_cache
        # RL trains the alphabet's rows (`lr`) and the layers at `body_lr`, by default not at all: the rows carry the
        # choices the reward is about (to call or to answer straight away, which item), while the layers moving at
        # 1e-4 and up let the reply's first token turn into the call's second (a newline) within one step in some
        # runs of the offline prototype, after which every episode fails and no group has an advantage left.
        groups: list[dict[str, Any]] = [{"params": [policy.rows], "lr": lr}]
        if body_lr > 0:
            groups.append({"params": policy.body_parameters(), "lr": body_lr})
        else:
            for p in policy.body_parameters():
                p.requires_grad_(False)
        self.optimizer = torch.optim.Adam(groups)
        self.clip, self.is_cap, self.minibatches = clip, is_cap, minibatches
        self.max_staleness = max_staleness
        self.weights_dir = weights_dir
        self.pusher = pusher
        self.version = 0
        self.kept: dict[int, torch.nn.Module] = {0: copy.deepcopy(policy.model)}
        self.adapter_dirs: dict[AdapterRevision, Path] | None = None  # --lora: each adapter revision's directory

    def model_of(self, version: Any) -> torch.nn.Module:
        return self.kept[int(version)]

    def filter_stale(self, groups: list[list[Sample]], current: int) -> tuple[list[list[Sample]], StalenessReport]:
        """The groups kept at collection (staleness in weight versions; the LoRA trainer counts revisions)."""
        return filter_stale(groups, current, self.max_staleness)

    async def push(self, version: int) -> float:
        path = save_weights(self.policy.model, self.weights_dir / f"v{version % 2}")
        result = await self.pusher.push(path, str(version), flush_cache=self.flush_cache)
        return result.seconds

    async def step(self, step: int, groups: list[Group]) -> StepRecord:
        started = time.perf_counter()
        current = self.version
        failed = sum(not r.ok for g in groups for r in g.results)
        healthy = [g for g in groups if all(r.ok and r.samples for r in g.results)]
        kept, staleness = self.filter_stale([[s for r in g.results for s in r.samples] for g in healthy], current)
        kept_ids = {id(samples[0]) for samples in kept}
        used = [g for g in healthy if id(g.results[0].samples[0]) in kept_ids]
        rewards = [x for g in groups for x in g.rewards(self.reward)]
        calls = [r.tool_calls > 0 for g in groups for r in g.results]
        record = StepRecord(step=step, version=current, reward_mean=float(np.mean(rewards)) if rewards else 0.0,
                            lookup_rate=float(np.mean(calls)) if calls else 0.0, episodes=len(rewards),
                            failed_episodes=failed, errors=[str(r.error) for g in groups for r in g.results
                                                            if r.error is not None][:5],
                            kept_groups=staleness.kept_groups,
                            dropped_groups=staleness.dropped_groups,
                            tokens_by_staleness=dict(sorted(staleness.tokens_by_staleness.items())), check_ok=True,
                            mismatch_max=0.0, mismatch_mean=0.0, mismatch_max_clean=0.0,
                            mismatch_max_straddled=math.nan, straddled_tokens=0, straddled_replies=0,
                            cache_hit_rate=cache_hit_rate([s for g in groups for r in g.results for s in r.samples]),
                            k3_kl=0.0,
                            train_rollout_logprob_abs_diff=0.0, pg_clipfrac=0.0, is_weight_mean=1.0,
                            push_seconds=0.0, seconds=0.0)
        if used:
            await asyncio.to_thread(self._train, record, used)
        else:  # nothing kept: nothing checked or trained this step
            record.mismatch_max = record.mismatch_mean = record.mismatch_max_clean = math.nan
        self.version = current + 1
        self.kept[self.version] = copy.deepcopy(self.policy.model)
        for old in [v for v in self.kept if v < self.version - self.max_staleness - 1]:
            del self.kept[old]
        record.push_seconds = await self.push(self.version)
        record.seconds = time.perf_counter() - started
        return record

    def _train(self, record: StepRecord, groups: list[Group]) -> None:
        episodes = [r.samples for g in groups for r in g.results]
        samples = [s for e in episodes for s in e]
        report = check_logprobs(samples, self.model_of, temperature=TEMPERATURE, worst=5, adapters=self.adapter_dirs)
        m = report.metrics
        record.check_ok = report.ok() and (report.ok_support() or not self.support)
        record.support_mismatch_max, record.unmasked_mismatch_max = support_figures(m)
        record.mismatch_max = report.max_abs_diff
        record.mismatch_mean = m.get("rollout_check/logprob_abs_diff_mean", 0.0)
        record.k3_kl = m.get("rollout_corr/k3_kl", 0.0)
        record.train_rollout_logprob_abs_diff = m.get("train_rollout_logprob_abs_diff", 0.0)
        record.worst = report.format().splitlines()[1:]
        clean, straddled = [], []
        for sample, check in zip(samples, report.per_sample, strict=True):
            diff = np.abs(check.trainer_log_probs - sample.rollout_log_probs)
            cut = straddled_mask(sample)
            sampled = sample.loss_mask.astype(bool)
            sampled[0] = False
            clean.append(diff[sampled & ~cut])
            straddled.append(diff[cut])
        record.mismatch_max_clean = float(np.concatenate(clean).max(initial=0.0))
        joined = np.concatenate(straddled)
        record.straddled_replies = sum(_straddled_turns(s) for s in samples)
        record.straddled_tokens = int(joined.size)
        record.mismatch_max_straddled = float(joined.max()) if joined.size else math.nan

        rewards = [x for g in groups for x in g.rewards(self.reward)]
        group_of = [i for i, g in enumerate(groups) for _ in g.results]
        advantages = group_advantages(rewards, group_of)
        batch = to_torch_batch(episodes=episodes)
        adv = torch.from_numpy(advantages)[batch["episode_index"]]
        ids, mask, attention = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        masks = batch_masks(batch) if self.support else None
        if self.support and masks is None:
            raise RuntimeError("sampled with top-k but the samples carry no sampling masks")
        with torch.no_grad():
            old = self.policy.log_probs(ids, mask, attention, masks)
        # The behaviour policy's logprob: over the kept set when the engine sampled from one.
        behaviour = batch["sampling_log_probs"] if masks is not None else batch["rollout_log_probs"]
        weights = truncated_is_weights(old, behaviour, mask, self.is_cap)
        rows = torch.randperm(len(ids))
        metrics: list[dict[str, float]] = []
        self.policy.model.train()
        for part in rows.chunk(self.minibatches):
            logp = self.policy.log_probs(ids[part], mask[part], attention[part], rows_of(masks, part))
            out = clipped_pg_loss(logp, old[part], adv[part], mask[part], clip_low=self.clip, clip_high=self.clip,
                                  is_weights=weights[part])
            self.optimizer.zero_grad()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.optimizer.step()
            metrics.append(out.metrics)
        self.policy.model.eval()
        self.policy.sync()
        record.pg_clipfrac = float(np.mean([x["pg_clipfrac"] for x in metrics]))
        record.is_weight_mean = float(np.mean([x.get("is_weight_mean", 1.0) for x in metrics]))
