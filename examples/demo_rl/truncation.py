"""`--top-k K [--top-p P]`: the demo with truncated sampling, trained with support-normalised ratios (issue 42).

Sampled with top-k / top-p, the engine draws each token from the set its sampler kept, renormalised: the behaviour
policy's logprob is the one over that set, not the full vocabulary's. So the session server runs with
`--return-sampling-masks --sampling-mask-top-k K` (every engine call asks SGLang for the kept ids of each token), the
episodes send `top_k` / `top_p`, and the trainer renormalises its own logprobs over each token's row
(`rollout.grpo.sampled_log_probs(..., sampling_masks=...)`) and weighs the policy gradient by the truncated ratio
against the engine's sampling logprobs (`Sample.sampling_log_probs`): unbiased, where the full-vocabulary ratio of
the same tokens is off by the kept mass. The step's check then also holds the support recompute to the engine's
sampling logprobs within 1e-3 (`LogprobCheckReport.ok_support`) and reports the full-vocabulary gap beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Truncation:
    """The episodes' top-k / top-p; `top_k` 0: the whole vocabulary, no masks (the demo's default)."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError("--top-k must be >= 0 and --top-p in (0, 1]")
        if self.top_p < 1 and self.top_k == 0:
            raise ValueError("--top-p needs --top-k: a sampling mask is recorded only under a finite top-k")

    @property
    def on(self) -> bool:
        return self.top_k > 0

    def server_args(self) -> tuple[str, ...]:
        """The session server's flags: masks on every engine call, bounded by this top-k."""
        return ("--return-sampling-masks", "--sampling-mask-top-k", str(self.top_k)) if self.on else ()

    def sampling(self) -> dict[str, Any]:
        """What each chat request adds to its body."""
        return {"top_k": self.top_k, "top_p": self.top_p} if self.on else {}


def batch_masks(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """to_torch_batch's padded rows (`sampling_mask_ids`, `sampling_mask_offsets`), None for a batch without."""
    if "sampling_mask_ids" not in batch:
        return None
    return batch["sampling_mask_ids"], batch["sampling_mask_offsets"]


def rows_of(masks: tuple[torch.Tensor, torch.Tensor] | None,
            part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of a minibatch's samples."""
    return None if masks is None else (masks[0][part], masks[1][part])


def support_figures(metrics: dict[str, float]) -> tuple[float, float]:
    """The check's worst |support recompute - engine's sampling logprob| and, beside it, the worst
    |full-vocabulary recompute - engine's sampling logprob| (nan, nan without masks)."""
    if not metrics.get("rollout_check/support_tokens"):
        return math.nan, math.nan
    return (metrics["rollout_check/support_logprob_abs_diff_max"],
            metrics["rollout_check/unmasked_logprob_abs_diff_max"])
