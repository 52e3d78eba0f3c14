"""rollout.grpo: group-relative advantages, the clipped loss with truncated importance sampling, the trainer's
logprobs of sampled tokens (the restricted-alphabet shortcut equal to the full softmax), per-token weight versions and
the staleness bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollout.grpo import (
    clipped_pg_loss,
    filter_stale,
    group_advantages,
    sample_staleness,
    sampled_log_probs,
    truncated_is_weights,
)
from trajectory import Sample, sample_metadata


def test_advantages_are_relative_to_the_group_and_scaled_by_its_std() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0, 5.0, 5.0], [0, 0, 0, 0, 1, 1])
    std = np.std([1.0, 0, 0, 0])
    np.testing.assert_allclose(adv[:4], (np.array([1.0, 0, 0, 0]) - 0.25) / (std + 1e-6), rtol=1e-6)
    assert adv[:4].sum() == pytest.approx(0.0, abs=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0]  # a group of equal rewards teaches nothing


def test_unscaled_advantages_only_subtract_the_group_mean() -> None:
    adv = group_advantages([3.0, 1.0, 10.0, 0.0], ["a", "a", "b", "b"], scale=False)
    assert adv.tolist() == [1.0, -1.0, 5.0, -5.0]


def test_advantages_refuse_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0], [0])


def test_truncated_is_weights_cap_the_ratio_to_the_behaviour_policy() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, math.exp(-0.5), 0.0]]))
    assert not w.requires_grad


def test_the_first_minibatch_is_the_plain_policy_gradient() -> None:
    """At ratio 1 (logp == old) the clipped loss is -A * ratio, whose gradient is -A * d logp, token-mean."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    out = clipped_pg_loss(logp, logp.detach(), adv, mask)
    out.loss.backward()
    assert logp.grad is not None
    expected = -(adv[:, None] * mask) / mask.sum()
    torch.testing.assert_close(logp.grad, expected)
    assert out.loss.item() == pytest.approx(-(1.0 * 3 - 2.0 * 2) / 5)
    assert out.metrics["pg_clipfrac"] == 0.0


def test_the_clip_stops_the_gradient_past_the_trust_region() -> None:
    old = torch.zeros(1, 4)
    # ratios e^0.5 (past 1.2) and e^-0.5 (below 0.8) with both signs of advantage
    logp = torch.tensor([[0.5, 0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.ones(1, 4)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = clipped_pg_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    out.loss.backward()
    assert logp.grad is not None
    # A > 0 and r > 1 + eps: clipped, no gradient; A < 0 and r > 1 + eps: the unclipped term is larger, gradient.
    # A > 0 and r < 1 - eps: unclipped term larger, gradient; A < 0 and r < 1 - eps: clipped, no gradient.
    grad = logp.grad[0]
    assert grad[0] == 0 and grad[3] == 0
    assert grad[1] > 0 and grad[2] < 0
    assert out.metrics["pg_clipfrac"] == pytest.approx(0.5)


def test_importance_weights_scale_each_token_and_carry_no_gradient() -> None:
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    w = torch.tensor([[2.0, 0.5]], requires_grad=True)
    out = clipped_pg_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), is_weights=w)
    out.loss.backward()
    assert logp.grad is not None and w.grad is None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]]))
    assert out.metrics["is_weight_mean"] == pytest.approx(1.25)


def _tiny_lm(vocab: int = 96) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).eval()


def _full_log_probs(model: torch.nn.Module, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logits = model(input_ids=ids).logits.float() / temperature
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_sampled_log_probs_are_the_full_softmax_on_the_mask_only() -> None:
    model = _tiny_lm()
    ids = torch.randint(0, 96, (2, 12))
    mask = torch.zeros(2, 12)
    mask[0, 5:9] = 1
    mask[1, 2:12] = 1
    with torch.no_grad():
        got = sampled_log_probs(model, ids, mask, temperature=0.7)
        full = _full_log_probs(model, ids, 0.7)
    assert (got[mask == 0] == 0).all()
    torch.testing.assert_close(got[:, 1:][mask[:, 1:] > 0], full[mask[:, 1:] > 0], atol=1e-5, rtol=0)


def _alphabet_lm() -> tuple[torch.nn.Module, torch.Tensor]:
    """A tiny LM whose output rows outside its alphabet are all zero (those tokens have logit exactly 0)."""
    model = _tiny_lm()
    alphabet = torch.tensor([3, 7, 8, 20, 41, 77])
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        keep = torch.zeros(96, dtype=torch.bool)
        keep[alphabet] = True
        weight[~keep] = 0
    return model, alphabet


def test_the_alphabet_shortcut_equals_the_full_softmax_when_other_rows_are_zero() -> None:
    model, alphabet = _alphabet_lm()
    ids = alphabet[torch.randint(0, len(alphabet), (3, 10))]
    mask = torch.ones(3, 10)
    mask[:, :3] = 0
    with torch.no_grad():
        got = sampled_log_probs(model, ids, mask, alphabet=alphabet)
        full = _full_log_probs(model, ids)
    torch.testing.assert_close(got[:, 1:][mask[:, 1:] > 0], full[mask[:, 1:] > 0], atol=1e-5, rtol=0)
    # Tokens outside the alphabet (zero rows: zero embeddings, logit 0) score as in the full softmax too, inputs
    # and targets alike; so does a trainable copy of the alphabet's rows standing for them.
    ids = torch.tensor([[3, 5, 7, 90, 8, 0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    rows = model.get_output_embeddings().weight[alphabet].detach().clone().requires_grad_(True)
    got = sampled_log_probs(model, ids, mask, alphabet=alphabet, alphabet_rows=rows)
    with torch.no_grad():
        full = _full_log_probs(model, ids)
    torch.testing.assert_close(got[0, 1:].detach(), full[0], atol=1e-5, rtol=0)
    got.sum().backward()
    assert rows.grad is not None and rows.grad.abs().sum() > 0


def _sample(spans: list[list[object]], n: int = 10, sampled: tuple[int, int] = (4, 10)) -> Sample:
    mask = np.zeros(n, dtype=np.uint8)
    mask[sampled[0]:sampled[1]] = 1
    return Sample(tokens=np.arange(n, dtype=np.int32), loss_mask=mask, rollout_log_probs=np.zeros(n, np.float32),
                  response_length=n - sampled[0], status="completed", metadata={"weight_version_spans": spans})


def test_token_versions_follow_the_spans_and_only_on_sampled_tokens() -> None:
    s = _sample([["3", 4, 7], ["4", 7, 10]])
    assert sample_metadata(s).version_ids().tolist() == [-1] * 4 + [3, 3, 3, 4, 4, 4]
    assert sample_staleness(s, 4) == 1 and sample_staleness(s, 3) == 0
    turn = Sample(tokens=np.arange(4, dtype=np.int32), loss_mask=np.array([0, 0, 1, 1], np.uint8),
                  rollout_log_probs=np.zeros(4, np.float32), response_length=2, status="completed",
                  metadata={"weight_version": "7"})
    assert sample_metadata(turn).version_ids().tolist() == [-1, -1, 7, 7]


def test_filter_stale_drops_whole_groups_beyond_the_bound_and_counts_tokens() -> None:
    fresh = [_sample([["5", 4, 10]]), _sample([["4", 4, 6], ["5", 6, 10]])]
    old = [_sample([["5", 4, 10]]), _sample([["3", 4, 10]])]
    kept, report = filter_stale([fresh, old], current=5, max_staleness=1)
    assert kept == [fresh]
    assert (report.kept_groups, report.dropped_groups, report.dropped_samples) == (1, 1, 2)
    assert report.tokens_by_staleness == {0: 10, 1: 2}
    kept, report = filter_stale([fresh, old], current=5, max_staleness=1, mode="mark")
    assert len(kept) == 2 and report.marked_groups == 1
    assert all(s.metadata.get("stale") for s in old) and not any(s.metadata.get("stale") for s in fresh)
    assert report.tokens_by_staleness == {0: 16, 1: 2, 2: 6}


def test_the_alphabet_shortcut_renormalises_over_sampling_mask_rows_as_the_full_softmax() -> None:
    """A kept id outside the alphabet (a zero row: logit exactly 0) counts in its row's logsumexp as the full
    path counts it; a position without a row keeps the full softmax."""
    model, alphabet = _alphabet_lm()
    ids = torch.tensor([[3, 7, 8, 20, 41, 77, 3, 8]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    rows = [[], [], [8, 7, 50], [20, 3], [41, 90, 91, 92], [], [], [8]]  # position 6 sampled without a row
    offsets = torch.tensor([[0, *np.cumsum([len(r) for r in rows]).tolist()]])
    kept = torch.tensor([[i for r in rows for i in r]])
    masks = (kept, offsets)
    with torch.no_grad():
        short = sampled_log_probs(model, ids, mask, alphabet=alphabet, sampling_masks=masks)
        full = sampled_log_probs(model, ids, mask, sampling_masks=masks)
        plain = sampled_log_probs(model, ids, mask)
        logits = model(input_ids=ids).logits.float()[0]
    torch.testing.assert_close(short, full, atol=1e-5, rtol=0)
    expected = logits[3, 41] - torch.logsumexp(logits[3, [41, 90, 91, 92]], -1)  # position 4, predicted at 3
    torch.testing.assert_close(short[0, 4], expected, atol=1e-5, rtol=0)
    assert short[0, 7] == 0.0 and abs(float(short[0, 6] - plain[0, 6])) < 1e-6 and short[0, 2] > plain[0, 2] + 1
