"""What the benchmarks share: the engine + server pair pinned to cores, /proc readers, percentiles, the JSON report
(figures, git state, machine) and its `--compare` table, and the optional py-spy profile.

Used by bench_session_responsiveness.py (top level), the benchmarks beside this module and the soaks (soaks/): a
benchmark imports what it shares from here, never from another benchmark. The child processes are launched by
harness.launchers, the project's one launcher.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np

from harness.launchers import RunningProcess, start_session_server, start_sim
from sglang_sim import directives

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024
INITIAL_AFFINITY = sorted(os.sched_getaffinity(0))  # before this process pins itself
T = TypeVar("T")

# ---------------------------------------------------------------------------------------------------------------
# Child processes, pinning, timing
# ---------------------------------------------------------------------------------------------------------------


def usable_cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


def all_cpus() -> set[int]:
    """Every online core (a child of a pinned process inherits the pinning otherwise)."""
    return set(range(os.cpu_count() or 1))


def affinity(pid: int) -> str:
    """The cores a process may run on, as /proc shows them ("0", "0-1")."""
    return proc_status(pid).get("Cpus_allowed_list", "?")


def pinning_plan(server_cpu: int | None, engine_cpu: int | None) -> tuple[int | None, int | None, str]:
    """Keep the requested cores if this machine has them, else run unpinned and say so."""
    cpus = usable_cpus()
    wanted = [c for c in (server_cpu, engine_cpu) if c is not None]
    if len(cpus) < 2 or any(c not in cpus for c in wanted):
        return None, None, f"unpinned (usable cpus {sorted(cpus)} do not allow the requested pinning)"
    return server_cpu, engine_cpu, "pinned"


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """The flags every server benchmark shares: the pinning, extra server flags, where logs and figures go."""
    p.add_argument("--server-cpu", type=int, default=0, help="core of session-server (-1: unpinned)")
    p.add_argument("--engine-cpu", type=int, default=1, help="core of sglang-sim (-1: unpinned)")
    p.add_argument("--server-arg", action="append", default=[], help="extra session-server argument (repeatable)")
    p.add_argument("--log-dir", default=None, help="where child logs go (default: a temp dir)")
    p.add_argument("--json-out", default=None, help="write the figures + config + git state to FILE")


def parse_stack_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`p.parse_args(argv)` with a negative core read as unpinned (None)."""
    args = p.parse_args(argv)
    args.server_cpu = None if args.server_cpu < 0 else args.server_cpu
    args.engine_cpu = None if args.engine_cpu < 0 else args.engine_cpu
    return args


def start_pair(
    *,
    tokenizer: str,
    family: str,
    engine_cpu: int | None,
    server_cpu: int | None,
    log_dir: Path | None,
    engine_args: Sequence[str],
    server_args: Sequence[str],
    server_src: str | None = None,
) -> tuple[RunningProcess, RunningProcess]:
    """The emulated engine, then the session server in front of it, each on its own core (None: unpinned).

    `server_src`: a source tree put first on the server's PYTHONPATH, to measure a patched copy against the installed
    code."""
    print(f"starting sglang-sim (cpu {engine_cpu}) and session-server (cpu {server_cpu}); logs in {log_dir}")
    sim = start_sim(tokenizer, family, *engine_args, cpus=_cores(engine_cpu), log_dir=log_dir, startup_timeout=120.0)
    try:
        server = start_session_server(
            sim.url, tokenizer, family, *server_args, cpus=_cores(server_cpu), log_dir=log_dir,
            startup_timeout=120.0, python_path=[server_src] if server_src else (),
        )
    except BaseException:
        sim.stop()
        raise
    return sim, server


FLOOR_READY = re.compile(r"floor-proxy ready on (http://\S+)")


def start_floor(engine_url: str, *args: str, cpu: int | None, log_dir: Path | None) -> RunningProcess:
    """The floor (benchmarks/floor_proxy.py) in front of `engine_url`, pinned like the server it stands in for."""
    cmd = [sys.executable, "-P", "-m", "benchmarks.floor_proxy", "--engine-url", engine_url, "--port", "0", *args]
    return RunningProcess(cmd, ready_pattern=FLOOR_READY, name="floor-proxy", cpus=_cores(cpu), log_dir=log_dir,
                          startup_timeout=60.0, python_path=[ROOT])


def floor_args(server_args: Sequence[str]) -> list[str]:
    """The floor flags that mirror the server's (the same engine requests: routed experts, delta streaming)."""
    keep = ("--return-routed-experts", "--engine-incremental-streaming")
    return [a for a in server_args if a in keep]


def _cores(cpu: int | None) -> set[int] | None:
    return None if cpu is None else {cpu}


def tool_schemas(n: int) -> list[dict[str, Any]]:
    """N realistic function schemas (every agent of a run sends the same ones, as agent frameworks do)."""
    return [
        {"type": "function", "function": {
            "name": f"tool_{i}",
            "description": f"Tool number {i}: looks up a record by key and returns its fields as JSON.",
            "parameters": {"type": "object", "properties": {
                "key": {"type": "string", "description": "the record key"},
                "fields": {"type": "array", "items": {"type": "string"}, "description": "fields to return"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            }, "required": ["key"]},
        }}
        for i in range(n)
    ]


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop, like the servers (uvicorn[standard] brings it), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main)
    return uvloop.run(main)


def median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall seconds per call of `fn()` over `repeat` timed calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------------------------
# /proc readers
# ---------------------------------------------------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all threads, clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_schedstat(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for a CPU) summed over the live threads: ns resolution, and the
    wait shows when other load on the machine, not the process itself, held it back."""
    run = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        run += int(fields[0])
        wait += int(fields[1])
    return run, wait


def proc_runtime_ns(pid: int) -> int:
    """Nanosecond CPU time summed over the live threads, for per-request resolution."""
    return proc_schedstat(pid)[0]


def system_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat (idle + iowait are not busy)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    total = sum(ticks[:8])
    return (total - ticks[3] - ticks[4]) / CLK_TCK, total / CLK_TCK


def proc_status(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def proc_kib(pid: int, key: str) -> int:
    """A VmXXX figure of /proc/PID/status in KiB (VmHWM is the peak resident set)."""
    return int(proc_status(pid).get(key, "0 kB").split()[0])


def proc_io(pid: int) -> dict[str, int]:
    """rchar/wchar: bytes moved through read/write syscalls (sockets included)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except OSError:
        return {}


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


# ---------------------------------------------------------------------------------------------------------------
# Figures, git, compare
# ---------------------------------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit, size in (("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def pct(values: Iterable[float], q: float) -> float | None:
    arr = np.asarray(list(values), dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else None


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"commit": None, "dirty": None, "error": str(exc)}


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        model = next(
            (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(), "usable_cpus": INITIAL_AFFINITY, "cpu_model": model,
        "python": platform.python_version(), "platform": platform.platform(),
    }


@dataclass
class Figures:
    """Named figures with their unit, which direction is better, and an absolute noise floor for --compare."""

    values: dict[str, float | int | None] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, name: str, value: float | int | None, unit: str, better: str | None = None, floor: float = 0.0):
        if isinstance(value, float):
            value = round(value, 6)
        self.values[name] = value
        self.meta[name] = {"unit": unit, "better": better, "floor": floor}


def write_report(path: str, benchmark: str, config: dict[str, Any], figures: Figures, **extra: Any) -> None:
    doc = {
        "benchmark": benchmark, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git": git_state(), "machine": machine_info(), "config": config,
        "figures": figures.values, "figure_meta": figures.meta, **extra,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def print_figures(figures: Figures, benchmark: str, config: dict[str, Any], json_path: str | None) -> None:
    """One line per figure (name, value, unit); with `json_path`, the report written there too."""
    for name, value in figures.values.items():
        print(f"{name:48s} {value:>14,.1f} {figures.meta[name]['unit']}")
    if json_path:
        write_report(json_path, benchmark, config, figures)


def verdict(a: float, b: float, better: str | None, band: float, floor: float) -> str:
    delta = b - a
    if abs(delta) <= max(band * abs(a), floor):
        return "same (within noise)"
    if better is None:
        return "changed"
    improved = delta > 0 if better == "higher" else delta < 0
    return "**better**" if improved else "**worse**"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def compare(path_a: str, path_b: str, band: float) -> str:
    """Markdown table B vs A; a difference counts only beyond max(band * |A|, the figure's absolute floor)."""
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    lines = [
        f"A = `{path_a}` ({label_of(a)}), B = `{path_b}` ({label_of(b)}); noise band +-{band:.0%} "
        "or the figure's absolute floor, whichever is larger.",
        "",
        "| figure | unit | A | B | B-A | B/A | verdict |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    meta = {**a.get("figure_meta", {}), **b.get("figure_meta", {})}
    for name in [*a["figures"], *(n for n in b["figures"] if n not in a["figures"])]:
        va, vb = a["figures"].get(name), b["figures"].get(name)
        m = meta.get(name, {})
        if isinstance(va, int | float) and isinstance(vb, int | float) and not isinstance(va, bool):
            ratio = f"{vb / va:.2f}x" if va else "-"
            v = verdict(float(va), float(vb), m.get("better"), band, float(m.get("floor", 0.0)))
            lines.append(f"| {name} | {m.get('unit', '')} | {fmt(va)} | {fmt(vb)} | {fmt(vb - va)} | {ratio} | {v} |")
        else:
            lines.append(f"| {name} | {m.get('unit', '')} | {fmt(va)} | {fmt(vb)} | - | - | missing |")
    return "\n".join(lines)


def label_of(doc: dict[str, Any]) -> str:
    cfg = doc.get("config", {})
    git = doc.get("git", {})
    parts = [cfg.get("label") or doc.get("benchmark", "?")]
    if "inline_decode" in cfg:
        parts.append("inline decode" if cfg["inline_decode"] else "pooled decode")
    parts.append(f"commit {str(git.get('commit'))[:10]}{' dirty' if git.get('dirty') else ''}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Profile (optional)
# ---------------------------------------------------------------------------------------------------------------


def start_profiler(pid: int, out: str, duration: float, rate: int = 200) -> subprocess.Popen[bytes] | None:
    """py-spy on the server for the load window; `.txt` writes collapsed stacks, anything else a flame graph.

    Only the thread holding the GIL is sampled (`--gil`): the server is one GIL-bound process pinned to one core, so
    that is where its core goes; threads runnable but waiting for the GIL or the core would otherwise look busy."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        print("py-spy not installed; --profile ignored (pip install -e '.[bench]')", file=sys.stderr)
        return None
    fmt_ = "raw" if out.endswith(".txt") else "flamegraph"
    cmd = [exe, "record", "--pid", str(pid), "--output", out, "--format", fmt_, "--rate", str(rate),
           "--duration", str(max(1, round(duration))), "--nonblocking", "--threads", "--gil"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize_collapsed(path: str, top: int = 15) -> list[tuple[str, float, float]]:
    """(function, % of samples on top of the stack, % of samples anywhere in the stack) from py-spy raw output."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        # "func (file.py:LINE)" -> "func (file.py)": one row per function, not per line.
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";") if not f.startswith(("thread (", "process "))]
        samples += count
        if frames:
            own[frames[-1]] += count
        for f in set(frames):
            total[f] += count
    if not samples:
        return []
    return [(f, 100 * c / samples, 100 * total[f] / samples) for f, c in own.most_common(top)]


# ---------------------------------------------------------------------------------------------------------------
# Load: words and user messages
# ---------------------------------------------------------------------------------------------------------------

_WORD_TEXT = (
    "alpha beta gamma delta rollout policy gradient token session server engine reward episode agent tool "
    "search result value model train step batch sample loss mask cache prefix radix memory latency budget "
    "python numpy tensor kernel thread loop queue worker shard replica weight update pause resume abort"
)
WORDS = tuple(_WORD_TEXT.split())


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def user_message(rng: random.Random, session: int, turn: int, user_words: int, reply_tokens: int) -> dict[str, str]:
    """A user turn of `user_words` words that asks the emulated engine for a `reply_tokens`-token reply."""
    text = f"Session {session} turn {turn}: {words(rng, user_words)} {directives.tokens(reply_tokens)}"
    return {"role": "user", "content": text}


# ---------------------------------------------------------------------------------------------------------------
# /health poller (its own process, its own connection)
# ---------------------------------------------------------------------------------------------------------------


def poll_health(url: str, interval_s: float, cpu: int | None, stop: Any, conn: Any) -> None:
    """Hit GET /health every interval; send back (start, latency, ok, lateness) rows.

    Runs in its own process so the load generator's event loop and GIL cannot delay it. After a stall the next
    poll starts at once (no burst to catch up), so a long stall is one long sample, as an agent would see it.
    """
    os.sched_setaffinity(0, {cpu} if cpu is not None else all_cpus())  # not the load generator's pinning
    rows: list[tuple[float, float, bool, float]] = []
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=url, limits=limits, timeout=60.0) as client:
        conn.send("ready")
        next_t = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if next_t > now:
                time.sleep(next_t - now)
            t0 = time.monotonic()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            t1 = time.monotonic()
            rows.append((t0, t1 - t0, ok, max(0.0, t0 - next_t)))
            next_t = max(next_t + interval_s, t1)
    conn.send(rows)


class HealthPoller:
    """GET /health at a fixed interval from a process of its own, pinned apart from the load generator."""

    def __init__(self, url: str, interval_s: float, cpu: int | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=poll_health, args=(url, interval_s, cpu, self._stop, send), daemon=True)

    def start(self) -> None:
        self.proc.start()
        if not self._recv.poll(60) or self._recv.recv() != "ready":
            raise RuntimeError("health poller did not start")

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.proc.pid) if self.proc.pid else 0.0

    def finish(self) -> np.ndarray:
        """Rows as an array of shape (n, 4): start, latency, ok, lateness (seconds)."""
        self._stop.set()
        rows = self._recv.recv() if self._recv.poll(60) else []
        self.proc.join(10)
        return np.asarray(rows, dtype=np.float64).reshape(-1, 4)
