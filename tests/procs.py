"""Child-process launchers for end-to-end tests (`start_sim`, `start_session_server`, `RunningProcess`).

The implementation lives in `rollout.processes` so the demo, the benchmarks and the tests share one launcher; this
module keeps the short import path the test files use (`from procs import start_sim`).
"""

from __future__ import annotations

from rollout.processes import (
    SERVER_READY,
    SIM_READY,
    ProcessCrashed,
    RunningProcess,
    free_port,
    start_session_server,
    start_sim,
)

__all__ = ["SERVER_READY", "SIM_READY", "ProcessCrashed", "RunningProcess", "free_port", "start_session_server",
           "start_sim"]
