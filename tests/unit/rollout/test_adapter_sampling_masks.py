"""The adapters hand sampling masks on: slime / miles `rollout_top_p_token_ids` / `_offsets` over the response
(a tool or glue token a row of itself) with the behaviour logprobs over the rows, verl's in its extra fields."""

from __future__ import annotations

import numpy as np

from rollout.adapters._common import response_sampling_masks
from rollout.adapters.slime import to_samples
from support.slime_sample import SlimeSample
from trajectory import Sample


def sample() -> Sample:
    """Prompt [1, 2], reply [7, 8] (rows [7, 3] and [8]), tool output [4], reply [9] (row [5, 9, 6])."""
    return Sample(tokens=np.array([1, 2, 7, 8, 4, 9], np.int32), loss_mask=np.array([0, 0, 1, 1, 0, 1], np.uint8),
                  rollout_log_probs=np.array([0, 0, -3, -4, 0, -5], np.float32), response_length=4,
                  status="completed", metadata={"turns": [[2, 2], [5, 1]],
                                                "weight_version_spans": [["v", 2, 4], ["v", 5, 6]]},
                  sampling_mask_ids=np.array([7, 3, 8, 5, 9, 6], np.int32),
                  sampling_mask_offsets=np.array([0, 0, 0, 2, 3, 3, 6], np.int64),
                  sampling_log_probs=np.array([0, 0, -0.5, 0, 0, -1.5], np.float32))


def test_the_response_rows_in_slimes_convention() -> None:
    got = response_sampling_masks(sample())
    assert got is not None
    ids, offsets, behaviour = got
    assert ids.dtype == offsets.dtype == np.int32
    assert ids.tolist() == [7, 3, 8, 4, 5, 9, 6] and offsets.tolist() == [0, 2, 3, 4, 7]  # the tool token alone
    assert behaviour.tolist() == [-0.5, 0.0, 0.0, -1.5]
    plain = sample()
    plain.sampling_mask_ids = plain.sampling_mask_offsets = plain.sampling_log_probs = None
    assert response_sampling_masks(plain) is None


def test_slime_and_miles_get_the_top_p_fields_and_behaviour_logprobs() -> None:
    for kind in ("torch", "numpy"):
        (item,) = to_samples([sample()], SlimeSample(), experts_as=kind)
        ids, offsets = item.rollout_top_p_token_ids, item.rollout_top_p_token_offsets
        assert type(ids).__module__.split(".")[0] == kind and len(offsets) == item.response_length + 1
        assert int(offsets[-1]) == len(ids)
        assert item.rollout_log_probs == [-0.5, 0.0, 0.0, -1.5]  # the engine's over each row, 0 off the mask
