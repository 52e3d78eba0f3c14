"""How many examples a hypothesis property runs: its full count in `make test` (and CI), a fraction in `make test-fast`.

Each property's count is tuned to what it needs to find the bugs it guards against; `make test-fast` is the inner loop
run after every edit, where the same properties at a fraction of their examples (TEST_EXAMPLES_SCALE, at least
MINIMUM) keep it within seconds. Failures found either way are replayed first from hypothesis' example database.
"""

from __future__ import annotations

import math
import os

MINIMUM = 10
SCALE = float(os.environ.get("TEST_EXAMPLES_SCALE", "1"))


def examples(count: int) -> int:
    """`count` examples scaled by TEST_EXAMPLES_SCALE (1 unless set), never fewer than MINIMUM or than `count` when
    that is already below it."""
    return max(min(count, MINIMUM), math.ceil(count * SCALE))
