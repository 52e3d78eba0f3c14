"""One parametrisable process stack for end-to-end tests: `sglang-sim`, optionally a recording proxy in front of it,
and any number of `session-server`s, started in parallel and stopped in reverse order.

Every e2e module builds its stack through `launch_stack` (the `stack_factory` fixture in tests/conftest.py), so the
lifecycle rules live in one place: session servers are started at once (loading the tokenizer is the slow part),
a failed start stops everything already running, and at teardown each session server must exit 0 on SIGTERM (a
crash or an unclean exit fails the module with the process's output tail).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.processes import RunningProcess, start_session_server, start_sim

from .server import RecordingProxy


@dataclass
class Stack:
    """URLs of a running stack. `stack["server"]`-style access is kept for the tests' brevity."""

    family: str
    tok: Path
    logs: Path
    engine: str  # the sim, always direct (the proxy, if any, sits between the servers and the sim)
    servers: dict[str, str] = field(default_factory=dict)
    proxy: RecordingProxy | None = None
    procs: list[RunningProcess] = field(default_factory=list)

    @property
    def server(self) -> str:
        return self.servers["server"]

    def __getitem__(self, key: str) -> Any:
        if key in self.servers:
            return self.servers[key]
        return getattr(self, key)


StackFactory = Callable[..., contextlib.AbstractContextManager[Stack]]


@contextlib.contextmanager
def launch_stack(
    tokenizer_dirs: Mapping[str, Path],
    logs: Path,
    *,
    family: str = "qwen3",
    sim_args: Sequence[str] = (),
    servers: Mapping[str, Sequence[str]] | None = None,
    proxied: Collection[str] = (),
) -> Iterator[Stack]:
    """Start the sim, then one session server per entry of `servers` (name -> extra CLI args; default one plain
    server named "server"). The servers named in `proxied` reach the sim through one RecordingProxy
    (`stack.proxy`), so a test can compare what a server stored with what the engine received and generated."""
    tok = tokenizer_dirs[family]
    stack = Stack(family=family, tok=tok, logs=logs, engine="")
    started: list[RunningProcess] = []
    try:
        sim = start_sim(tok, family, *sim_args, log_dir=logs)
        started.append(sim)
        stack.engine = sim.url
        if proxied:
            stack.proxy = RecordingProxy(sim.url)
        pending = [
            start_session_server(
                stack.proxy.url if stack.proxy is not None and name in proxied else sim.url,
                tok, family, *args, name=name, log_dir=logs, wait=False,
            )
            for name, args in (servers if servers is not None else {"server": ()}).items()
        ]
        started += pending
        for proc in pending:
            proc.wait_ready()
            stack.servers[proc.name] = proc.url
        stack.procs = started
        yield stack
    finally:
        failures = []
        for proc in reversed(started):
            code = proc.stop()
            if proc is not started[0] and code != 0:
                failures.append(f"{proc.name} exited with {code} on SIGTERM:\n{proc.tail()}")
        if stack.proxy is not None:
            stack.proxy.close()
    assert not failures, "\n".join(failures)
