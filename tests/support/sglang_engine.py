"""Real SGLang engines for the real-engine tier (tests/sglang): released SGLang 0.5.23 serving the tiny random
checkpoints (scripts/build_tiny_checkpoints.py) on the CPU, from its own venv, with the test-only plugin
(tests/sglang/plugin) on its PYTHONPATH.

A launch costs 40-80 s of both cores and ~3.7 GB, so engines are shared by every module of a run (`Engines`, a
session fixture): started on first use, restarted where they were (same port) when a test has killed one, stopped
by PID at the end. What a test may assume of a shared engine: it runs and queues nothing, and holds no KV beyond its
radix cache (`assert_engine_clean`).

Nothing here reads a private structure: the engine's books are SGLang's own `GET /v1/loads` report
(`num_running_reqs`, `num_waiting_reqs`, `num_used_tokens`: KV slots held by requests and sessions, not by the
evictable radix cache) and `POST /flush_cache`, which SGLang refuses while any request or session holds KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.launchers import SGLANG_CPU_PLUGIN, EngineProcess, RunningProcess, start_sglang

from .server import RecordingProxy

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class EngineSpec:
    checkpoint: str
    args: tuple[str, ...] = ()


# No free whitespace inside constrained JSON: a random model's greedy choice is often a whitespace token, which
# xgrammar's default grammar admits without end; without it, a finite schema always ends in a few tokens.
CONSTRAINED = ("--constrained-json-disable-any-whitespace",)
# Qwen3's reasoning parser, as a deployment of a thinking model runs: a request that says `require_reasoning` has its
# grammar held back until `</think>` (the session server sends it for a constrained turn in thinking mode). Nothing
# else changes for a /generate without a grammar (the engine only counts the reasoning's tokens).
REASONING = ("--reasoning-parser", "qwen3")
MOE = EngineSpec("qwen3-moe", (*CONSTRAINED, "--enable-return-routed-experts"))
SPECS = {
    "dense": EngineSpec("qwen3-dense", (*CONSTRAINED, *REASONING)),
    "moe": MOE,
    "moe-b": MOE,  # a second worker of the same model, behind a router with "moe" (tests/sglang/test_real_routers.py)
    # The tiny random Qwen3-VL (issue 34): SGLang's default vision attention wants a GPU kernel; sdpa runs on the CPU.
    "vl": EngineSpec("qwen3-vl", ("--mm-attention-backend", "sdpa", "--dtype", "float32")),
    # LoRA (issue 40): the tiny adapters of scripts/build_tiny_adapters.py ({adapters}: their directory, built on first
    # use), a1 and a2 loaded at start, room for one more revision; the plugin's pin-memory patch lets it start.
    "lora": EngineSpec("qwen3-dense", (
        "--enable-lora", "--lora-paths", "a1={adapters}/a1", "a2={adapters}/a2", "--max-lora-rank", "4",
        "--lora-target-modules", "q_proj", "v_proj", "--lora-backend", "torch_native", "--max-loaded-loras", "3",
        "--max-loras-per-batch", "3")),
}
ADAPTERS_DIR = "lora-qwen3-dense"  # under the checkpoints


@dataclass
class Engines:
    """The run's real engines by name (SPECS), started on first use."""

    python: Path
    checkpoints: Path
    logs: Path
    running: dict[str, EngineProcess] = field(default_factory=dict)

    def checkpoint(self, name: str) -> Path:
        path = self.checkpoints / name
        assert (path / "config.json").exists(), f"{path} missing: run `make test-sglang` (it builds the checkpoints)"
        return path

    def get(self, name: str) -> EngineProcess:
        """The engine `name`, running (restarted on its own port if a test killed it)."""
        proc = self.running.get(name)
        if proc is not None and proc.proc.poll() is None:
            return proc
        return self.start(name, port=None if proc is None else proc.port)

    def start(self, name: str, port: int | None = None) -> EngineProcess:
        spec = SPECS[name]
        old = self.running.pop(name, None)
        if old is not None:
            old.stop()
        log = self.logs / f"sglang-{name}-{time.monotonic_ns()}.log"
        args = spec.args
        if any("{adapters}" in arg for arg in args):
            args = tuple(arg.replace("{adapters}", str(self.adapters())) for arg in args)
        proc = start_sglang(self.python, self.checkpoint(spec.checkpoint), *args, plugin_dir=SGLANG_CPU_PLUGIN,
                            port=port, name=f"sglang[{name}]", log_path=log)
        self.running[name] = proc
        return proc

    def adapters(self) -> Path:
        """The tiny LoRA adapters' directory, built with the engine's venv when absent (atomically: a temp dir
        renamed into place, so a shared cache is never rebuilt under another run)."""
        out = self.checkpoints / ADAPTERS_DIR
        if not out.exists():
            subprocess.run([str(self.python), "-m", "scripts.build_tiny_adapters", "--base",
                            str(self.checkpoint("qwen3-dense")), "--out", str(out)], cwd=REPO, check=True, timeout=600)
        return out

    def stop(self, name: str) -> None:
        """Stop the engine `name` now (a module's own engine: its ~3.7 GB back before the next module starts)."""
        proc = self.running.pop(name, None)
        if proc is not None:
            proc.stop()

    def close(self) -> None:
        for proc in self.running.values():
            proc.stop()
        self.running.clear()


@contextlib.contextmanager
def paced(engine: str, seconds_per_step: float) -> Iterator[None]:
    """The engine at a fixed pace while the block runs: SGLang's own test hook `POST /slow_down` makes its scheduler
    sleep `seconds_per_step` before every forward batch (prefill or one decode step), so a reply of N tokens takes at
    least N * seconds_per_step however fast the machine is. A test whose verdict needs a reply to outlast a deadline
    (an abort, a timeout, a pause mid-reply) runs paced, with the pace chosen so the reply outlasts it tenfold; the
    pace is lifted on the way out (`forward_sleep_time` 0), whatever happened in the block (an engine the block
    killed took its pace with it)."""
    slow_down(engine, seconds_per_step)
    try:
        yield
    finally:
        with contextlib.suppress(httpx.TransportError):
            slow_down(engine, 0.0)


def slow_down(engine: str, seconds: float) -> None:
    """SGLang's `/slow_down`: `seconds` of sleep before each forward batch from now on (0: none)."""
    r = httpx.post(f"{engine}/slow_down", json={"forward_sleep_time": seconds}, timeout=60)
    assert r.status_code == 200, r.text


def loads(engine: str) -> dict[str, Any]:
    """SGLang's own load report (`GET /v1/loads`) of its one data-parallel rank."""
    body = httpx.get(f"{engine}/v1/loads", timeout=10).json()
    (rank,) = body["loads"]
    return dict(rank)


async def wait_loads(engine: str, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll the engine's load report (from a test's event loop, under the caller's `asyncio.timeout`) until
    `until(report)`; return that report."""
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            (report,) = (await http.get(f"{engine}/v1/loads")).json()["loads"]
            if until(report):
                return dict(report)
            await asyncio.sleep(0.05)


def wait_engine_idle(engine: str, timeout: float = 30.0) -> dict[str, Any]:
    """Poll until the engine runs and queues nothing; return its load report."""
    deadline = time.monotonic() + timeout
    while True:
        report = loads(engine)
        if report["num_running_reqs"] == 0 and report["num_waiting_reqs"] == 0:
            return report
        assert time.monotonic() < deadline, f"engine not idle after {timeout}s: {report}"
        time.sleep(0.05)


def assert_engine_clean(engine: str, timeout: float = 30.0) -> None:
    """No request runs or waits, no KV slot is held by a request or a session, and the radix cache flushes (SGLang
    refuses a flush while anything holds KV); after the flush no token slot is in use at all."""
    wait_engine_idle(engine, timeout)
    deadline = time.monotonic() + timeout
    while (report := loads(engine))["num_used_tokens"] != 0:
        assert time.monotonic() < deadline, f"KV still held: {report}"
        time.sleep(0.05)
    flushed = httpx.post(f"{engine}/flush_cache", timeout=30)
    assert flushed.status_code == 200, flushed.text
    assert loads(engine)["num_used_tokens"] == 0


@dataclass
class Served:
    """A session server in front of a real engine, through a recording proxy (always, unless the test asked for none:
    then `proxy` is None and the test does not read it)."""

    server: str
    engine: str
    proxy: RecordingProxy
    proc: RunningProcess
    checkpoint: Path


ServeFactory = Callable[..., contextlib.AbstractContextManager[Served]]
