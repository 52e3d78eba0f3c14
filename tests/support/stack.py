"""One parametrisable process stack for end-to-end tests: `sglang-sim`, optionally a recording proxy in front of it,
and any number of `session-server`s, started in parallel and stopped in reverse order.

Every e2e module builds its stack through `launch_stack` (the `stack_factory` fixture in tests/conftest.py), so the
lifecycle rules live in one place: session servers are started at once (loading the tokenizer is the slow part),
a failed start stops everything already running, and at teardown each session server must exit 0 on SIGTERM (a
crash or an unclean exit fails the module with the process's output tail).

The data-parallel modules (several sims behind one server or router) build theirs with `launch_fleet` (the
`fleet_factory` fixture): the sims started at once, then whatever the module puts in front of them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.launchers import RunningProcess, start_session_server, start_sim

from .server import RecordingProxy, start_parallel

# Seconds a process of a stack may take to become ready: a bound that only turns a hang into a failure. Several
# tokenizer loads at once on a loaded 2-core machine take tens of seconds (issue 30); when fast it costs nothing.
STARTUP_TIMEOUT = 300.0


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
    cpus: Collection[int] | None = None,
) -> Iterator[Stack]:
    """Start the sim, then one session server per entry of `servers` (name -> extra CLI args; default one plain
    server named "server"). The servers named in `proxied` reach the sim through one RecordingProxy
    (`stack.proxy`), so a test can compare what a server stored with what the engine received and generated.
    `cpus`: the cores the sim and the servers may run on (tests/support/contention.py loads them)."""
    tok = tokenizer_dirs[family]
    stack = Stack(family=family, tok=tok, logs=logs, engine="")
    started: list[RunningProcess] = []
    try:
        sim = start_sim(tok, family, *sim_args, log_dir=logs, cpus=cpus, startup_timeout=STARTUP_TIMEOUT)
        started.append(sim)
        stack.engine = sim.url
        if proxied:
            stack.proxy = RecordingProxy(sim.url)
        pending = [
            start_session_server(
                stack.proxy.url if stack.proxy is not None and name in proxied else sim.url,
                tok, family, *args, name=name, log_dir=logs, wait=False, cpus=cpus, startup_timeout=STARTUP_TIMEOUT,
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


@dataclass
class Fleet:
    """Data-parallel sims (`sims`) and the processes a module starts in front of them with `start` (`procs`, the
    sims first); `server` is the URL of the session server in front, once the module has started one."""

    tok: Path
    logs: Path
    sims: list[RunningProcess]
    procs: list[RunningProcess]
    server: str = ""

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sims]

    def start(self, proc: RunningProcess) -> RunningProcess:
        """Keep a started process to stop (in reverse order) when the fleet closes."""
        self.procs.append(proc)
        return proc


FleetFactory = Callable[..., contextlib.AbstractContextManager[Fleet]]


@contextlib.contextmanager
def launch_fleet(
    tokenizer_dirs: Mapping[str, Path], logs: Path, *, family: str = "qwen3", sims: int = 2,
    sim_args: Sequence[str] = (),
) -> Iterator[Fleet]:
    """Start `sims` sims at once (each with `sim_args`, logging to sim<i>.log); every process of the fleet is stopped
    in reverse order when it closes."""
    tok = tokenizer_dirs[family]
    procs: list[RunningProcess] = []
    try:
        procs += start_parallel(*(
            functools.partial(start_sim, tok, family, *sim_args, log_path=logs / f"sim{i}.log",
                              startup_timeout=STARTUP_TIMEOUT)
            for i in range(sims)
        ))
        yield Fleet(tok, logs, procs[:sims], procs)
    finally:
        for proc in reversed(procs):
            proc.stop()
