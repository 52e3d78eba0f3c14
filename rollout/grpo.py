"""GRPO loop pieces a trainer reuses: group-relative advantages, the clipped policy-gradient loss with truncated
importance sampling against the rollout logprobs, per-token weight versions and the staleness bound at collection,
and the trainer's logprobs of the sampled tokens.

The loss is the one TRL's GRPOTrainer and verl's actor compute (their documented formulas; none of their code):

- advantages (GRPO): each episode's reward minus the mean of its group (the G episodes of one prompt), divided by the
  group's standard deviation (`scale=False` skips the division, as Dr. GRPO and TRL's `scale_rewards="none"` do);
  every sampled token of an episode gets the episode's advantage;
- ratio `r = exp(logp - logp_old)`, with `logp_old` the trainer's logprobs at the weights the step starts from (so the
  first minibatch has r = 1 and later ones clip, as PPO's minibatches do), per-token loss
  `max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))`;
- the behaviour policy is the engine's: each token's loss is weighted by the truncated importance ratio
  `min(exp(logp_old - logp_rollout), cap)`, detached (verl's token-level `rollout_is` "truncate" mode, TRL's
  `vllm_importance_sampling_correction` with `vllm_importance_sampling_cap`). It corrects both a numeric mismatch
  between engine and trainer and staleness: a token sampled by weights one update older than the trainer's;
- aggregation "token-mean": the sum over every sampled token of the minibatch divided by their count (verl's default,
  DAPO's).

Sampling masks (top-k / top-p sampling, trajectory/sampling_masks.py): the engine sampled each token from its kept set
renormalised, so the behaviour policy's logprob is `Sample.sampling_log_probs`, and the trainer's must be renormalised
over the same set: `sampled_log_probs(..., sampling_masks=(batch["sampling_mask_ids"],
batch["sampling_mask_offsets"]))` gives support-normalised logprobs, and `truncated_is_weights` against
`batch["sampling_log_probs"]` then weighs each token by an unbiased ratio (miles' and slime's sampling-support
replay).

Staleness: a sample carries the weight version of every sampled token (`weight_version_spans`, written by the
session server from SGLang's `meta_info.weight_version(s)`, read by `trajectory.sample_metadata`); with integer
versions (`parse`, by default `trajectory.parse_version`: "default" is step 0), a token's staleness is the trainer's
version minus its own. `filter_stale` drops (or keeps and marks) the groups with a token older than
`max_staleness` versions, as TRL's and SkyRL's `max_staleness` and miles' `--max-weight-staleness` bound it, and
counts what it did.

torch is imported here (the trainer's side); `import rollout` stays torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from trajectory import Sample, parse_version, sample_metadata

StaleMode = Literal["drop", "mark"]


# -- advantages ------------------------------------------------------------------------------------------------------

def group_advantages(rewards: Sequence[float], groups: Sequence[int], *, scale: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
    """Each reward minus its group's mean, divided by the group's (population) standard deviation plus `eps` when
    `scale`. A group whose rewards are all equal gets advantage 0 everywhere: it teaches nothing."""
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    if r.shape != g.shape or r.ndim != 1:
        raise ValueError(f"rewards and groups must be 1-D of one length, got {r.shape} and {g.shape}")
    out = np.zeros_like(r)
    for group in np.unique(g):
        members = g == group
        centred = r[members] - r[members].mean()
        out[members] = centred / (r[members].std() + eps) if scale else centred
    return out.astype(np.float32)


# -- loss --------------------------------------------------------------------------------------------------------------

def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                         cap: float = 2.0) -> torch.Tensor:
    """`min(exp(old - rollout), cap)` on sampled tokens, 0 elsewhere, without gradient: the truncated importance weight
    of the trainer's policy against the engine's (the behaviour policy)."""
    if cap <= 0:
        raise ValueError("cap must be positive")
    log_ratio = (old_log_probs - rollout_log_probs).detach().clamp(max=math.log(cap))
    return torch.exp(log_ratio) * loss_mask


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def clipped_pg_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                    is_weights: torch.Tensor | None = None) -> LossOutput:
    """The clipped surrogate on [B, L] per-token tensors, token-mean over `loss_mask`.

    `advantages` is [B] (one per row, spread over its tokens) or [B, L]; `is_weights` (e.g. `truncated_is_weights`)
    multiplies each token's loss. Metrics: the loss, the fraction of tokens the clip bound, the k3 KL of the update
    (new against old) and the mean importance weight."""
    mask = loss_mask.to(log_probs.dtype)
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    log_ratio = log_probs - old_log_probs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    tokens = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        clipfrac = (((clipped > unclipped).to(mask.dtype)) * mask).sum() / tokens
        k3 = ((torch.exp(-log_ratio) - 1 + log_ratio) * mask).sum() / tokens
        metrics = {"pg_loss": float(loss), "pg_clipfrac": float(clipfrac), "ppo_kl_k3": float(k3)}
        if is_weights is not None:
            metrics["is_weight_mean"] = float((is_weights * mask).sum() / tokens)
    return LossOutput(loss, metrics)


# -- the trainer's logprobs ------------------------------------------------------------------------------------------

def sampled_log_probs(model: torch.nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, temperature: float = 1.0,
                      alphabet: torch.Tensor | None = None, alphabet_rows: torch.Tensor | None = None,
                      sampling_masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[B, L] logprobs of each token where `loss_mask` is 1 (0.0 elsewhere) under a transformers causal LM, with the
    output head applied only at the positions that predict a sampled token (a [positions, vocab] block instead of
    [B, L, vocab]: a 151k vocabulary makes the full one gigabytes).

    `alphabet`: the only output rows that are not all zero (a policy trained on a restricted alphabet keeps every
    other row of its tied embedding at exactly 0, so each of those tokens has logit exactly 0): the logsumexp is then
    taken over the alphabet's logits plus log(vocab - len(alphabet)) for the rest, the same number as the full
    softmax at a fraction of its cost (a token outside it scores its logit 0). `alphabet_rows` ([len(alphabet), hidden],
    e.g. a trainable copy of those rows) stands for the model's own rows of a tied embedding, on the input side too
    (every other token embeds to the zero vector, as its zero row says).

    `sampling_masks`: to_torch_batch's (`sampling_mask_ids`, `sampling_mask_offsets`): each token with a row is
    renormalised over it (the support-normalised logprob the engine sampled it with); tokens without one keep the
    full softmax."""
    body = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if body is None or head is None:
        raise TypeError("need a transformers causal LM (a .model body and an output embedding)")
    weight = head.weight
    vocab = weight.shape[0]
    index = None
    if alphabet is not None:
        index = torch.full((vocab,), -1, dtype=torch.long)
        index[alphabet] = torch.arange(len(alphabet))
    if alphabet_rows is not None:
        if index is None or alphabet_rows.shape[0] != len(index[index >= 0]):
            raise ValueError("alphabet_rows needs the alphabet, one row per token")
        local_ids = index[input_ids]
        embeds = alphabet_rows[local_ids.clamp(min=0)] * (local_ids >= 0).unsqueeze(-1).to(alphabet_rows.dtype)
        hidden = body(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
    else:
        hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    rows, cols = torch.nonzero(loss_mask[:, 1:], as_tuple=True)
    states = hidden[rows, cols]  # the state at t-1 predicts the token at t
    targets = input_ids[rows, cols + 1]
    scale = temperature if temperature > 0 else 1.0
    if index is None or alphabet is None:
        logits = (states @ weight.T).float() / scale
        norm = torch.logsumexp(logits, dim=-1)
        if sampling_masks is not None:
            norm = _over_rows(lambda ids: logits.gather(-1, ids), norm, sampling_masks, rows, cols + 1)
        picked = logits.gather(-1, targets[:, None])[:, 0] - norm
    else:
        local = index[targets]
        out_rows = weight[alphabet] if alphabet_rows is None else alphabet_rows
        logits = (states @ out_rows.T).float() / scale
        rest = torch.full((len(logits), 1), math.log(vocab - len(alphabet)), dtype=logits.dtype)
        # A token outside the alphabet has logit exactly 0 (its row is zero).
        target_logit = torch.where(local >= 0, logits.gather(-1, local.clamp(min=0)[:, None])[:, 0], 0.0)
        norm = torch.logsumexp(torch.cat([logits, rest], -1), dim=-1)
        if sampling_masks is not None:  # a kept id outside the alphabet has logit exactly 0 too
            def alphabet_logits(ids: torch.Tensor) -> torch.Tensor:
                kept = index[ids]
                return torch.where(kept >= 0, logits.gather(-1, kept.clamp(min=0)), 0.0)

            norm = _over_rows(alphabet_logits, norm, sampling_masks, rows, cols + 1)
        picked = target_logit - norm
    out = torch.zeros(loss_mask.shape, dtype=picked.dtype)
    out[rows, cols + 1] = picked
    return out


def _over_rows(logits_of: Callable[[torch.Tensor], torch.Tensor], full: torch.Tensor,
               masks: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Per scored position (rows, cols), the logsumexp over its sampling-mask row of the logits `logits_of` gives for
    a [positions, width] block of token ids (`full`, the whole vocabulary's, where it has none)."""
    ids, offsets = masks
    start, end = offsets[rows, cols], offsets[rows, cols + 1]
    lengths = end - start
    width = int(lengths.max()) if len(lengths) else 0
    if width == 0:
        return full
    reach = torch.arange(width, device=full.device)
    valid = reach[None, :] < lengths[:, None]
    at = (start[:, None] + reach[None, :]).clamp(max=ids.shape[1] - 1)
    kept = logits_of(ids[rows[:, None], at].clamp(min=0)).masked_fill(~valid, float("-inf"))
    return torch.where(lengths > 0, torch.logsumexp(kept, dim=-1), full)


# -- weight versions and staleness -----------------------------------------------------------------------------------

def sample_staleness(sample: Sample, current: int, parse: Callable[[str], int] = parse_version) -> int:
    """How many versions behind `current` the sample's oldest sampled token is (0 when every one is current)."""
    oldest, _ = sample_metadata(sample).version_range(parse)
    return current - oldest if oldest is not None else 0


@dataclass
class StalenessReport:
    """What the bound did at one collection: groups kept and dropped, marked ones, and sampled tokens per staleness."""

    kept_groups: int = 0
    dropped_groups: int = 0
    marked_groups: int = 0
    dropped_samples: int = 0
    tokens_by_staleness: dict[int, int] = field(default_factory=dict)

    def add_tokens(self, sample: Sample, current: int, parse: Callable[[str], int]) -> None:
        versions = sample_metadata(sample).version_ids(parse)
        sampled = versions[sample.loss_mask.astype(bool)]
        for staleness, count in zip(*np.unique(current - sampled, return_counts=True), strict=True):
            key = int(staleness)
            self.tokens_by_staleness[key] = self.tokens_by_staleness.get(key, 0) + int(count)


def filter_stale(groups: Sequence[Sequence[Sample]], current: int, max_staleness: int, *, mode: StaleMode = "drop",
                 parse: Callable[[str], int] = parse_version) -> tuple[list[list[Sample]], StalenessReport]:
    """Bound staleness at collection: a group (the samples of one prompt's G episodes: GRPO's baseline needs them
    together) holding a token more than `max_staleness` versions older than `current` is dropped, or with
    mode="mark" kept with `metadata["stale"] = True` on each of its samples. Returns the groups kept and the report
    (the kept groups' sampled tokens counted by staleness)."""
    if max_staleness < 0:
        raise ValueError("max_staleness must be >= 0")
    report = StalenessReport()
    kept: list[list[Sample]] = []
    for group in groups:
        worst = max((sample_staleness(s, current, parse) for s in group), default=0)
        if worst > max_staleness:
            if mode == "drop":
                report.dropped_groups += 1
                report.dropped_samples += len(group)
                continue
            report.marked_groups += 1
            for s in group:
                s.metadata["stale"] = True
        kept.append(list(group))
        report.kept_groups += 1
        for s in group:
            report.add_tokens(s, current, parse)
    return kept, report
