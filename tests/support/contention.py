"""Deliberate CPU contention: busy loops pinned to the core the processes under test run on.

Why: the fault paths (a burst of engine control calls, a stopped engine, a killed and restarted server) once held on
an idle machine and broke on a slow, loaded one (228 x 502 from a burst; 97 engine sessions left open). Pinning the
stack to one core (`CONTENDED_CORE`, via the launcher's `cpus`) and running `BURNERS` busy loops there gives it a
fraction of one core, whatever the machine; the tests then wait for events, never for a time.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

BURNERS = 2  # busy loops beside the stack on its core: the stack gets about a third of it


def contended_core() -> int:
    """The core the contended stack and its burners share: the last one this process may use (the test client
    keeps the others)."""
    return max(os.sched_getaffinity(0))


@contextlib.contextmanager
def busy_loops(core: int, n: int = BURNERS) -> Iterator[None]:
    """`n` busy-loop processes pinned to `core` for the duration of the block; killed and reaped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                              preexec_fn=lambda: os.sched_setaffinity(0, {core})) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
