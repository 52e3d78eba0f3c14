"""What one training step measured (`StepRecord`), and its verdict on the logprob check: what the trainer writes and
the table, the plot and the summary read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    step: int
    version: int                    # the weights the step trained from (the next push is version + 1)
    reward_mean: float
    lookup_rate: float              # the fraction of episodes that called the tool
    episodes: int
    failed_episodes: int
    kept_groups: int
    dropped_groups: int
    tokens_by_staleness: dict[int, int]
    check_ok: bool                  # the check over every sampled token: within 1e-3
    mismatch_max: float             # the check's worst |engine - trainer| logprob over every sampled token
    mismatch_mean: float
    mismatch_max_clean: float       # over tokens whose reply ran on one version only
    mismatch_max_straddled: float   # over tokens sampled after an update, on KV of the older weights (nan: none)
    straddled_tokens: int
    straddled_replies: int          # replies that ran across a push (recomputed under the new weights by the server)
    cache_hit_rate: float           # prompt tokens served by the engine's prefix cache / prompt tokens (nan: none)
    k3_kl: float
    train_rollout_logprob_abs_diff: float
    pg_clipfrac: float
    is_weight_mean: float
    push_seconds: float
    seconds: float
    worst: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # why the failed episodes failed (the first few)
    # With --top-k (truncation.py): the worst |support recompute - engine's sampling logprob|, and the full-vocabulary
    # recompute's beside it (the bias a ratio without masks would carry); nan without masks.
    support_mismatch_max: float = math.nan
    unmasked_mismatch_max: float = math.nan
    # With --lora: the step's episodes whose turns ran on more than one adapter revision (a revision pushed while the
    # episode ran, its next turn on the new one: --adapter-revisions latest).
    episodes_across_revisions: int = 0


def verdict(r: StepRecord) -> str:
    """"ok": every token within 1e-3; "ok*": every token of a reply on one version within it (the rest straddled an
    update); "FAIL" otherwise; "-" when nothing was kept."""
    if math.isnan(r.mismatch_max):
        return "-"
    if r.check_ok:
        return "ok"
    return "ok*" if r.mismatch_max_clean <= 1e-3 else "FAIL"
