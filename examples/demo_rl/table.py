"""The run's table: one line per step, printed at the end."""

from __future__ import annotations

import math

from examples.demo_rl.step_record import StepRecord, verdict


def table(records: list[StepRecord]) -> str:
    """One line per step: reward, lookups, episodes, groups kept/dropped, tokens by staleness, the check, the push."""
    head = (f"{'step':>4} {'ver':>3} {'reward':>6} {'lookup':>6} {'eps':>4} {'fail':>4} {'kept':>4} {'drop':>4} "
            f"{'stale0/1/2+':>13} {'check':>5} {'mismatch max':>12} {'clean':>9} {'straddled':>9} {'k3_kl':>8} "
            f"{'cache':>5} {'push s':>6} {'step s':>6}")
    lines = [head, "-" * len(head)]
    for r in records:
        t = r.tokens_by_staleness
        stale = f"{t.get(0, 0)}/{t.get(1, 0)}/{sum(v for k, v in t.items() if k >= 2)}"
        straddled = "-" if math.isnan(r.mismatch_max_straddled) else f"{r.mismatch_max_straddled:.2e}"
        lines.append(f"{r.step:>4} {r.version:>3} {r.reward_mean:>6.2f} {r.lookup_rate:>6.2f} {r.episodes:>4} "
                     f"{r.failed_episodes:>4} {r.kept_groups:>4} {r.dropped_groups:>4} {stale:>13} {verdict(r):>5} "
                     f"{r.mismatch_max:>12.2e} {r.mismatch_max_clean:>9.2e} {straddled:>9} {r.k3_kl:>8.1e} "
                     f"{r.cache_hit_rate:>5.2f} {r.push_seconds:>6.2f} {r.seconds:>6.2f}")
    return "\n".join(lines)
