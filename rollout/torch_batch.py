"""`to_torch_batch`: training samples -> right-padded tensors for a policy-gradient step.

The only module of the package that imports torch, so a rollout worker that never builds batches does not pay
for it. Every per-token array of a `Sample` (tokens, loss mask, rollout logprobs) has the sample's full length,
with mask 0 and logprob 0.0 on prompt and inter-turn tokens; padding keeps those conventions (mask 0, logprob
0.0, attention 0), so `(loss * loss_mask).sum() / loss_mask.sum()` is correct on the padded batch as is.

A session whose history forked (a compaction, a sub-agent: trajectory/session_segments.py) yields one sample per
segment, so an episode may own several rows; `episodes` (e.g. `[r.samples for r in results if r.ok]`) builds the batch
from per-episode lists and adds `episode_index`, the row's episode, to spread one reward over all of an episode's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trajectory import Sample


def to_torch_batch(
    samples: Sequence[Sample] = (),
    pad_id: int = 0,
    *,
    episodes: Sequence[Sequence[Sample]] | None = None,
    pad_to_multiple_of: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Pad `samples` (or every sample of `episodes`, in order) on the right to one length.

    Returns `input_ids` int64 [B, L], `loss_mask` float32 [B, L] (1.0 on sampled tokens), `rollout_log_probs`
    float32 [B, L], `attention_mask` int64 [B, L] (1 on real tokens) and `response_lengths` int64 [B]; with
    `episodes`, also `episode_index` int64 [B] (the episode each row belongs to).

    With sampling masks (trajectory/sampling_masks.py) on any sample, each row's CSR padded: `sampling_mask_ids`
    int64 [B, M] (row b's kept ids, then -1), `sampling_mask_offsets` int64 [B, L + 1] (position t of row b keeps
    `sampling_mask_ids[b, offsets[b, t]:offsets[b, t + 1]]`; empty on padding and on samples without masks) and
    `sampling_log_probs` float32 [B, L] (the engine's logprob over the row, 0.0 elsewhere): what
    `grpo.sampled_log_probs(..., sampling_masks=...)` renormalises over.
    """
    episode_index = None
    if episodes is not None:
        if samples:
            raise ValueError("give samples or episodes, not both")
        samples = [s for episode in episodes for s in episode]
        episode_index = [i for i, episode in enumerate(episodes) for _ in episode]
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    lengths = [len(s.tokens) for s in samples]
    for i, s in enumerate(samples):
        if not (len(s.loss_mask) == len(s.rollout_log_probs) == lengths[i]):
            raise ValueError(
                f"sample {i}: tokens, loss_mask and rollout_log_probs differ in length "
                f"({lengths[i]}, {len(s.loss_mask)}, {len(s.rollout_log_probs)})"
            )
    width = max(lengths)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of

    input_ids = np.full((len(samples), width), pad_id, dtype=np.int64)
    loss_mask = np.zeros((len(samples), width), dtype=np.float32)
    log_probs = np.zeros((len(samples), width), dtype=np.float32)
    attention = np.zeros((len(samples), width), dtype=np.int64)
    for row, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        input_ids[row, :n] = s.tokens
        loss_mask[row, :n] = s.loss_mask
        log_probs[row, :n] = s.rollout_log_probs
        attention[row, :n] = 1

    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "loss_mask": torch.from_numpy(loss_mask),
        "rollout_log_probs": torch.from_numpy(log_probs),
        "attention_mask": torch.from_numpy(attention),
        "response_lengths": torch.tensor([s.response_length for s in samples], dtype=torch.int64),
    }
    if episode_index is not None:
        batch["episode_index"] = torch.tensor(episode_index, dtype=torch.int64)
    if any(s.sampling_masks is not None for s in samples):
        batch.update(_padded_masks(samples, width))
    if device is not None:
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
    return batch


def _padded_masks(samples: Sequence[Sample], width: int) -> dict[str, torch.Tensor]:
    masks = [s.sampling_masks for s in samples]
    most = max((len(m.ids) for m in masks if m is not None), default=0)
    ids = np.full((len(samples), max(most, 1)), -1, dtype=np.int64)
    offsets = np.zeros((len(samples), width + 1), dtype=np.int64)
    log_probs = np.zeros((len(samples), width), dtype=np.float32)
    for row, m in enumerate(masks):
        if m is None:
            continue
        n = len(m)
        ids[row, :len(m.ids)] = m.ids
        offsets[row, :n + 1] = m.offsets
        offsets[row, n + 1:] = m.offsets[-1]
        log_probs[row, :n] = m.logprobs
    return {"sampling_mask_ids": torch.from_numpy(ids), "sampling_mask_offsets": torch.from_numpy(offsets),
            "sampling_log_probs": torch.from_numpy(log_probs)}
