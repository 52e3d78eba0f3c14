"""to_torch_batch: right padding, dtypes, and the masked-loss convention; torch stays out of `import rollout`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.torch_batch import to_torch_batch
from trajectory import Sample


def make_sample(prompt: list[int], turns: list[tuple[list[int], list[int]]], status: str = "completed") -> Sample:
    """A merged sample: prompt (mask 0), then per turn the sampled tokens (mask 1) and the glue after (mask 0)."""
    tokens, mask, logprobs = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
    for sampled, glue in turns:
        tokens += sampled + glue
        mask += [1] * len(sampled) + [0] * len(glue)
        logprobs += [-0.25 * (i + 1) for i in range(len(sampled))] + [0.0] * len(glue)
    return Sample(
        tokens=np.array(tokens, dtype=np.int32),
        loss_mask=np.array(mask, dtype=np.uint8),
        rollout_log_probs=np.array(logprobs, dtype=np.float32),
        response_length=len(tokens) - len(prompt),
        status=status,
        metadata={"n": len(tokens)},
    )


@pytest.fixture
def samples() -> list[Sample]:
    return [
        make_sample([1, 2, 3], [([10, 11], [4, 5]), ([12], [])]),
        make_sample([1, 2], [([20, 21, 22], [])]),
        make_sample([7] * 9, [([30], [])], status="truncated"),
    ]


def test_padding_dtypes_and_values(samples: list[Sample]) -> None:
    batch = to_torch_batch(samples, pad_id=99)
    assert set(batch) == {"input_ids", "loss_mask", "rollout_log_probs", "attention_mask", "response_lengths"}
    assert batch["input_ids"].shape == (3, 10)
    assert batch["input_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["rollout_log_probs"].dtype == torch.float32
    assert batch["attention_mask"].dtype == torch.int64
    assert batch["response_lengths"].tolist() == [5, 3, 1]
    for row, s in enumerate(samples):
        n = len(s.tokens)
        assert batch["input_ids"][row, :n].tolist() == s.tokens.tolist()
        assert batch["loss_mask"][row, :n].tolist() == s.loss_mask.astype(float).tolist()
        assert np.array_equal(batch["rollout_log_probs"][row, :n].numpy(), s.rollout_log_probs)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (10 - n)
        assert batch["input_ids"][row, n:].eq(99).all()
        assert batch["loss_mask"][row, n:].eq(0).all() and batch["rollout_log_probs"][row, n:].eq(0).all()


def test_pad_to_multiple_of(samples: list[Sample]) -> None:
    assert to_torch_batch(samples, pad_id=0, pad_to_multiple_of=8)["input_ids"].shape == (3, 16)
    assert to_torch_batch(samples[:1], pad_id=0, pad_to_multiple_of=4)["input_ids"].shape == (1, 8)


def test_masked_policy_loss_counts_only_sampled_tokens(samples: list[Sample]) -> None:
    """The padded batch plugs into a masked mean as is: padding and prompt/glue tokens contribute nothing."""
    batch = to_torch_batch(samples, pad_id=0)
    mask = batch["loss_mask"]
    masked_mean = (-batch["rollout_log_probs"] * mask).sum() / mask.sum()
    sampled = np.concatenate([s.rollout_log_probs[s.loss_mask == 1] for s in samples])
    assert mask.sum().item() == len(sampled) == 7
    assert masked_mean.item() == pytest.approx(float(-sampled.mean()))


def test_episodes_with_several_segments_keep_their_rows_together(samples: list[Sample]) -> None:
    """An episode whose history forked has one sample per segment: its rows carry the same episode index, so one
    reward spreads over all of them."""
    batch = to_torch_batch(episodes=[samples[:2], [], samples[2:]], pad_id=0)
    assert batch["episode_index"].tolist() == [0, 0, 2]
    assert torch.equal(batch["input_ids"], to_torch_batch(samples, pad_id=0)["input_ids"])
    rewards = torch.tensor([1.0, 0.0, -1.0])
    assert rewards[batch["episode_index"]].tolist() == [1.0, 1.0, -1.0]
    with pytest.raises(ValueError, match="not both"):
        to_torch_batch(samples, episodes=[samples])


def test_rejects_empty_input() -> None:
    with pytest.raises(ValueError, match="zero samples"):
        to_torch_batch([], pad_id=0)
