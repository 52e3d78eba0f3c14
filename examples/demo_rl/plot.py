"""The run's PNG: reward and tool calls, the logprob mismatch and the tokens by staleness, per step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from examples.demo_rl.step_record import StepRecord


def plot(records: list[StepRecord], path: Path, title: str) -> Path:
    """Three panels: reward per step, the logprob mismatch per step (log scale), sampled tokens by staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    steps = [r.step for r in records]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax1.plot(steps, [r.reward_mean for r in records], marker="o", label="mean reward")
    ax1.plot(steps, [r.lookup_rate for r in records], linestyle="--", marker=".", label="episodes that called the tool")
    ax1.plot(steps, [r.cache_hit_rate for r in records], linestyle=":", marker="s",
             label="prefix cache hit rate (cached / prompt tokens)")
    ax1.set_ylabel("per episode / rate")
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_title(title)
    ax1.grid(alpha=0.3)
    floor = 1e-9  # a step whose worst token agrees exactly still shows on a log axis
    ax2.semilogy(steps, [max(r.mismatch_max, floor) for r in records], marker="o", label="max |diff|, all tokens")
    ax2.semilogy(steps, [max(r.mismatch_max_clean, floor) for r in records], marker=".",
                 label="max |diff|, replies on one version")
    ax2.semilogy(steps, [max(r.mismatch_mean, floor) for r in records], marker=".", label="mean |diff|")
    straddled = [(r.step, r.mismatch_max_straddled) for r in records if not math.isnan(r.mismatch_max_straddled)]
    if straddled:
        ax2.semilogy([s for s, _ in straddled], [max(v, floor) for _, v in straddled], "x",
                     label="max |diff|, tokens after an update mid-reply")
    ax2.axhline(1e-3, color="grey", linestyle="--", linewidth=1, label="1e-3 (fp32 bar)")
    ax2.set_ylabel("engine vs trainer logprob")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax2.grid(alpha=0.3)
    bottom = np.zeros(len(records))
    for staleness, label in ((0, "staleness 0"), (1, "staleness 1"), (2, "staleness 2+")):
        counts = np.array([sum(v for k, v in r.tokens_by_staleness.items()
                               if (k == staleness if staleness < 2 else k >= 2)) for r in records], dtype=float)
        ax3.bar(steps, counts, bottom=bottom, label=label)
        bottom += counts
    ax3.set_ylabel("sampled tokens trained on")
    ax3.set_xlabel("step")
    ax3.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    dropped = [r.dropped_groups for r in records]
    if any(dropped):
        twin = ax3.twinx()
        twin.plot(steps, dropped, "k.", label="groups dropped (too stale)")
        twin.set_ylabel("groups dropped")
        twin.legend(loc="upper right", fontsize=7)
    ax3.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
