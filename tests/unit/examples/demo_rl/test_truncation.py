"""examples/demo_rl/truncation.py: what `--top-k` / `--top-p` turn on in the server, the episodes and the trainer."""

from __future__ import annotations

import math

import pytest
import torch

from examples.demo_rl.truncation import Truncation, batch_masks, rows_of, support_figures


def test_off_by_default_and_each_side_told_when_on() -> None:
    off = Truncation()
    assert not off.on and off.server_args() == () and off.sampling() == {}
    on = Truncation(top_k=20, top_p=0.9)
    assert on.on and on.server_args() == ("--return-sampling-masks", "--sampling-mask-top-k", "20")
    assert on.sampling() == {"top_k": 20, "top_p": 0.9}
    with pytest.raises(ValueError, match="--top-p needs --top-k"):
        Truncation(top_p=0.9)
    with pytest.raises(ValueError, match="--top-k must be"):
        Truncation(top_k=-1)


def test_the_trainer_reads_the_batch_rows_and_the_checks_figures() -> None:
    ids, offsets = torch.tensor([[5, 6, -1], [7, -1, -1]]), torch.tensor([[0, 0, 2, 2], [0, 1, 1, 1]])
    masks = batch_masks({"sampling_mask_ids": ids, "sampling_mask_offsets": offsets})
    assert masks is not None and batch_masks({"input_ids": ids}) is None
    part = torch.tensor([1])
    picked = rows_of(masks, part)
    assert picked is not None and picked[0].tolist() == [[7, -1, -1]] and picked[1].tolist() == [[0, 1, 1, 1]]
    assert rows_of(None, part) is None
    assert support_figures({"rollout_check/support_tokens": 3.0, "rollout_check/support_logprob_abs_diff_max": 1e-5,
                            "rollout_check/unmasked_logprob_abs_diff_max": 0.4}) == (1e-5, 0.4)
    assert all(math.isnan(x) for x in support_figures({}))
