"""Responsiveness benchmark of the session server under bursts of concurrent first-turn chats.

Three processes, so that each figure belongs to the process it names: `sglang-sim` (the emulated engine, sending
routed-experts payloads of ~1.5 MiB of structured numeric rows) and `session-server` run as children pinned to
different cores; this process drives the load. Waves of K concurrent chats, each on its own fresh session
(created before, deleted after its wave so memory stays flat), run for a fixed window while a separate poller
process hits `GET /health` every 10 ms on its own connection: the poller's latency is the server's event-loop
stall, not the load generator's connection pool. CPU and memory come from /proc, git state from git.

    python bench_session_responsiveness.py --json-out out/pooled.json --plot out/pooled.png
    python bench_session_responsiveness.py --inline-decode --json-out out/inline.json
    python bench_session_responsiveness.py --compare out/inline.json out/pooled.json

The children are launched by harness.launchers; the helpers shared with benchmarks/bench_turn_overhead.py (pinning,
/proc readers, percentiles, JSON report and --compare, py-spy) live in benchmarks/benchlib.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.benchlib import (
    Figures,
    HealthPoller,
    affinity,
    all_cpus,
    compare,
    floor_args,
    fmt,
    human_bytes,
    pct,
    pinning_plan,
    proc_cpu_seconds,
    proc_io,
    proc_kib,
    proc_schedstat,
    proc_status,
    run_async,
    self_cpu_seconds,
    start_floor,
    start_pair,
    start_profiler,
    summarize_collapsed,
    system_cpu,
    tool_schemas,
    usable_cpus,
    write_report,
)
from sglang_sim import directives

ROOT = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------------------------
# Load generator
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    start: float = 0.0
    end: float = 0.0
    waves: int = 0
    chat_latency_s: list[float] = field(default_factory=list)
    reply_bytes: list[int] = field(default_factory=list)
    create_s: list[float] = field(default_factory=list)
    chat_phase_s: list[float] = field(default_factory=list)
    delete_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    phases: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, create|chat|delete)

    def phase_at(self, t: float) -> str:
        return next((name for start, end, name in self.phases if start <= t <= end), "between waves")

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.error_samples) < 8:
            self.error_samples.append(f"{kind}: {detail[:300]}")


def chat_body(wave: int, index: int, reply_tokens: int, tools: int = 0) -> dict[str, Any]:
    content = f"Wave {wave}, agent {index}: report your status. {directives.tokens(reply_tokens)}"
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max(2 * reply_tokens, 64),
        "temperature": 1.0,
    }
    if tools:
        body["tools"] = tool_schemas(tools)
    return body


async def create_session(client: httpx.AsyncClient, res: LoadResult) -> str | None:
    try:
        r = await client.post("/sessions", json={"metadata": {"bench": "responsiveness"}})
        if r.status_code == 200:
            return str(r.json()["session_id"])
        res.error("create", f"HTTP {r.status_code} {r.text}")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        res.error("create", repr(exc))
    return None


async def chat(client: httpx.AsyncClient, sid: str, body: dict[str, Any], res: LoadResult, record: bool) -> None:
    t0 = time.monotonic()
    try:
        r = await client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
        elapsed = time.monotonic() - t0
        if r.status_code != 200:
            res.error("chat", f"HTTP {r.status_code} {r.text}")
            return
        message = r.json()["choices"][0]["message"]
        if not isinstance(message, dict):
            res.error("chat", f"no message in {r.text[:200]}")
            return
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        res.error("chat", repr(exc))
        return
    if record:
        res.chat_latency_s.append(elapsed)
        res.reply_bytes.append(len(r.content))


async def delete_session(client: httpx.AsyncClient, sid: str, res: LoadResult) -> None:
    try:
        r = await client.delete(f"/sessions/{sid}")
        if r.status_code not in (200, 204):
            res.error("delete", f"HTTP {r.status_code} {r.text}")
    except httpx.HTTPError as exc:
        res.error("delete", repr(exc))


async def wave(
    clients: list[httpx.AsyncClient], number: int, k: int, reply_tokens: int, res: LoadResult, record: bool,
    tools: int = 0,
) -> None:
    """K fresh sessions, K concurrent first-turn chats, then the K sessions deleted."""
    pick = [clients[i % len(clients)] for i in range(k)]
    t0 = time.monotonic()
    sids = await asyncio.gather(*(create_session(c, res) for c in pick))
    t1 = time.monotonic()
    await asyncio.gather(
        *(chat(c, sid, chat_body(number, i, reply_tokens, tools), res, record)
          for i, (c, sid) in enumerate(zip(pick, sids, strict=True)) if sid)
    )
    t2 = time.monotonic()
    await asyncio.gather(*(delete_session(c, sid, res) for c, sid in zip(pick, sids, strict=True) if sid))
    t3 = time.monotonic()
    if record:
        res.phases += [(t0, t1, "create"), (t1, t2, "chat"), (t2, t3, "delete")]
        res.create_s.append(t1 - t0)
        res.chat_phase_s.append(t2 - t1)
        res.delete_s.append(t3 - t2)


async def run_load(url: str, args: argparse.Namespace, on_start: Callable[[], None]) -> LoadResult:
    """Warm-up waves (not recorded), then waves until the window is over; every started wave completes."""
    res = LoadResult()
    # Several small clients instead of one with K connections: httpx's pool bookkeeping grows with its size, and
    # with one big pool the load generator, not the server, was the bottleneck.
    shards = max(1, min(args.client_shards, args.concurrency))
    per_shard = -(-args.concurrency // shards)
    limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    tty = sys.stderr.isatty()
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout))
            for _ in range(shards)
        ]
        for w in range(args.warmup_waves):
            await wave(clients, -1 - w, args.concurrency, args.reply_tokens, res, record=False, tools=args.tools)
        on_start()
        res.start = time.monotonic()

        async def progress() -> None:
            while True:
                await asyncio.sleep(1.0)
                now = time.monotonic()
                done = len(res.chat_latency_s)
                line = (
                    f"[load] {now - res.start:5.1f}/{args.duration:.0f} s  waves {res.waves:3d}  chats {done:5d}  "
                    f"{done / (now - res.start):6.1f} chats/s  errors {sum(res.errors.values())}"
                )
                print(line, end="\r" if tty else "\n", file=sys.stderr, flush=True)

        ticker = asyncio.create_task(progress())
        try:
            while time.monotonic() - res.start < args.duration:
                await wave(clients, res.waves, args.concurrency, args.reply_tokens, res, record=True, tools=args.tools)
                res.waves += 1
        finally:
            ticker.cancel()
        res.end = time.monotonic()
        if tty:
            print(file=sys.stderr)
    return res  # errors of the warm-up waves are counted too: a failure must not hide


# ---------------------------------------------------------------------------------------------------------------
# Engine response probe
# ---------------------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer_dir: str, reply_tokens: int, tools: int = 0) -> list[int]:
    """The token ids of the benchmark's first-turn prompt, rendered as the server renders it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    body = chat_body(0, 0, reply_tokens, tools)
    ids = tok.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(map(int, ids))


def routed_experts_layers(tokenizer_dir: str, reply_tokens: int, tools: int, n_bytes: int) -> int:
    """The layer count that makes one chat's routed experts about `n_bytes`.

    SGLang's payload has a row per position of the whole sequence (prompt + reply - 1) on a first turn, so its size
    depends on how long the benchmark's chats are: the sim's `--routed-experts-bytes` sizes it for a 1k-token
    sequence, which on these ~100-token chats sent ~90 KiB instead of the ~1.5 MiB the benchmark is about."""
    from sglang_sim.routed_experts import DEFAULT_TOP_K, layers_for_bytes

    tokens = len(prompt_ids(tokenizer_dir, reply_tokens, tools)) + reply_tokens
    return layers_for_bytes(n_bytes, DEFAULT_TOP_K, tokens=tokens)


def probe_engine_response(engine_url: str, tokenizer_dir: str, reply_tokens: int) -> dict[str, Any]:
    """Size of one /generate response for the benchmark's prompt, asked the way the server asks (5.1)."""
    ids = prompt_ids(tokenizer_dir, reply_tokens)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max(2 * reply_tokens, 64), "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_routed_experts": True,
        "rid": f"bench-probe-{os.getpid()}",
    }
    t0 = time.monotonic()
    r = httpx.post(f"{engine_url}/generate", json=body, timeout=60.0)
    elapsed = time.monotonic() - t0
    out: dict[str, Any] = {"status": r.status_code, "bytes": len(r.content), "prompt_tokens": len(ids),
                           "latency_s": elapsed}
    try:
        doc = r.json()
        meta = doc.get("meta_info", {})
        out["completion_tokens"] = meta.get("completion_tokens")
        experts = meta.get("routed_experts")
        out["routed_experts_bytes"] = len(json.dumps(experts, separators=(",", ":"))) if experts is not None else 0
        out["routed_experts_head"] = json.dumps(experts)[:120] if experts is not None else None
    except ValueError:
        pass
    return out


# ---------------------------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------------------------


def plot_health(path: str, base_ms: np.ndarray, load_ms: np.ndarray, load_t: np.ndarray, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for data, label, color in ((base_ms, "baseline (idle)", "tab:blue"), (load_ms, "under load", "tab:red")):
        if data.size:
            xs = np.sort(data)
            ys = 1.0 - np.arange(xs.size) / xs.size
            ax1.step(xs, ys, where="post", color=color,
                     label=f"{label}: p50 {np.percentile(data, 50):.2f}, p99 {np.percentile(data, 99):.2f} ms")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("GET /health latency (ms)")
    ax1.set_ylabel("fraction of polls slower (1 - CDF)")
    ax1.axvline(20, color="gray", linestyle="--", linewidth=1, label="p99 target 20 ms")
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    if load_ms.size:
        ax2.plot(load_t, load_ms, ".", markersize=2, color="tab:red")
    ax2.set_yscale("log")
    ax2.set_xlabel("time into the load window (s)")
    ax2.set_ylabel("GET /health latency (ms)")
    ax2.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".cache/tokenizers/qwen3", help="tokenizer dir (AutoTokenizer)")
    p.add_argument("--model-family", default="qwen3")
    p.add_argument("--concurrency", "-k", type=int, default=64, help="chats per wave (K)")
    p.add_argument("--duration", type=float, default=10.0, help="load window in seconds")
    p.add_argument("--warmup-waves", type=int, default=1)
    p.add_argument("--baseline-seconds", type=float, default=3.0, help="idle /health polling before the load")
    p.add_argument("--health-interval-ms", type=float, default=10.0)
    p.add_argument("--reply-tokens", type=int, default=32, help="reply length asked with [[sim: tokens N]]")
    p.add_argument("--tools", type=int, default=0,
                   help="tool schemas sent with every first turn (rendered into the prompt: a heavier first turn)")
    p.add_argument("--routed-experts-bytes", type=int, default=1536 * 1024, help="sglang-sim payload per response")
    p.add_argument("--no-routed-request", action="store_true",
                   help="do not pass --return-routed-experts to the server (for a server without that flag)")
    p.add_argument("--token-latency-ms", type=float, default=0.0, help="sglang-sim per-token latency")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--client-shards", type=int, default=8, help="httpx clients the K sessions are spread over")
    p.add_argument("--server-cpu", type=int, default=0, help="core of session-server (-1: unpinned)")
    p.add_argument("--engine-cpu", type=int, default=1, help="core of sglang-sim (-1: unpinned)")
    p.add_argument("--loadgen-cpu", type=int, default=None,
                   help="core of this load generator (default: the engine's core; -1: unpinned)")
    p.add_argument("--poller-cpu", type=int, default=-1, help="core of the /health poller (default unpinned)")
    p.add_argument("--cpu-workers", type=int, default=None, help="passed to session-server --cpu-workers")
    p.add_argument("--inline-decode", action="store_true", help="session-server decodes on the event loop")
    p.add_argument("--server-arg", action="append", default=[], help="extra session-server argument (repeatable)")
    p.add_argument("--engine-arg", action="append", default=[], help="extra sglang-sim argument (repeatable)")
    p.add_argument("--server-src", default=None,
                   help="run session-server from this source tree (PYTHONPATH first), e.g. a patched copy")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the floor (benchmarks/floor_proxy.py in the server's place, same engine, same load), "
                   "which is otherwise measured first and reported beside every CPU figure")
    p.add_argument("--pairs", type=int, default=1,
                   help="measure the floor and the server alternately this many times (floor, server, floor, ...) "
                   "and report each pair's per-chat ratio and their median: the machine drifts between runs of a "
                   "few seconds, and pairs see the same drift; the other figures are the last pair's")
    p.add_argument("--label", default=None, help="name of this run in --compare output")
    p.add_argument("--json-out", default=None, help="write all figures + config + git state to FILE")
    p.add_argument("--plot", default=None, help="PNG of /health latency under load vs baseline")
    p.add_argument("--profile", default=None, help="py-spy the server during the load window (.svg or .txt)")
    p.add_argument("--log-dir", default=None, help="where child logs go (default: a temp dir)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print a markdown diff table and exit")
    p.add_argument("--noise-band", type=float, default=0.10, help="relative noise band for --compare")
    args = p.parse_args(argv)
    for name in ("server_cpu", "engine_cpu", "poller_cpu"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            setattr(args, name, None)
    if args.loadgen_cpu is None:
        args.loadgen_cpu = args.engine_cpu
    elif args.loadgen_cpu < 0:
        args.loadgen_cpu = None
    return args


def health_figures(figs: Figures, prefix: str, ms: np.ndarray) -> None:
    for q in (50, 95, 99):
        figs.add(f"{prefix}_p{q}_ms", pct(ms, q), "ms", "lower", floor=1.0)
    figs.add(f"{prefix}_max_ms", float(ms.max()) if ms.size else None, "ms", "lower", floor=5.0)
    figs.add(f"{prefix}_polls", int(ms.size), "count")


@dataclass
class Measurement:
    """Everything one run measured, raw: the figures and the report are pure functions of it."""

    args: argparse.Namespace
    pin_note: str
    pinning: dict[str, Any]
    probe: dict[str, Any]
    res: LoadResult
    rows: np.ndarray  # health polls: start, latency s, ok, lateness s
    baseline_end: float
    cpu_s: dict[str, float]  # server, engine, loadgen, poller: CPU seconds during the load window
    server_wait_s: float  # time the server's threads were runnable but waited for a CPU
    machine_busy: float  # cores busy machine-wide during the window
    rss_kib: dict[str, int]  # before, peak, after
    engine_wchar: int
    engine_info: dict[str, Any]
    logs: dict[str, str]
    shared_core: bool  # the load generator shares the engine's core

    @property
    def wall(self) -> float:
        return self.res.end - self.res.start


def measure(args: argparse.Namespace, floor: bool = False) -> Measurement:
    """Start the engine and the server (or, `floor`, the floor proxy) pinned, poll /health idle, then under waves of
    K chats; stop both."""
    server_cpu, engine_cpu, pin_note = pinning_plan(args.server_cpu, args.engine_cpu)
    loadgen_cpu = args.loadgen_cpu if pin_note == "pinned" and args.loadgen_cpu in usable_cpus() else None
    poller_cpu = args.poller_cpu if pin_note == "pinned" and args.poller_cpu in usable_cpus() else None
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-responsiveness-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    engine_args = ["--token-latency-ms", str(args.token_latency_ms), *args.engine_arg]
    if args.routed_experts_bytes > 0:
        layers = routed_experts_layers(args.tokenizer, args.reply_tokens, args.tools, args.routed_experts_bytes)
        engine_args += ["--routed-experts-layers", str(layers)]
    server_args = list(args.server_arg)
    if args.routed_experts_bytes > 0 and not args.no_routed_request:
        server_args.append("--return-routed-experts")  # else the engine sends no payload (docs/design.md 5.1: opt-in)
    if args.cpu_workers is not None:
        server_args += ["--cpu-workers", str(args.cpu_workers)]
    if args.inline_decode:
        server_args.append("--inline-decode")

    sim, server = start_pair(
        tokenizer=args.tokenizer, family=args.model_family, engine_cpu=engine_cpu, server_cpu=server_cpu,
        log_dir=log_dir, engine_args=engine_args, server_args=server_args, server_src=args.server_src,
    )
    if floor:  # the same engine, the floor proxy in the server's place (and on its core)
        server.stop()
        server = start_floor(sim.url, *floor_args(server_args), cpu=server_cpu, log_dir=log_dir)
    poller = HealthPoller(server.url, args.health_interval_ms / 1000.0, poller_cpu)
    profiler = None
    try:
        if loadgen_cpu is not None:
            os.sched_setaffinity(0, {loadgen_cpu})
        pinning = {
            "note": pin_note,
            "session-server": affinity(server.pid), "sglang-sim": affinity(sim.pid),
            "load generator": proc_status(os.getpid()).get("Cpus_allowed_list"),
        }
        probe = probe_engine_response(sim.url, args.tokenizer, args.reply_tokens)
        print(f"engine /generate response asking for routed experts: {human_bytes(probe['bytes'])} "
              f"(routed experts {human_bytes(probe.get('routed_experts_bytes', 0))}, HTTP {probe['status']})")
        poller.start()
        pinning["health poller"] = proc_status(poller.proc.pid).get("Cpus_allowed_list")
        print("pinning: " + ", ".join(f"{k} -> cpus {v}" for k, v in pinning.items() if k != "note")
              + f" ({pin_note})")
        time.sleep(args.baseline_seconds)
        baseline_end = time.monotonic()
        marks: dict[str, Any] = {}

        def on_start() -> None:
            nonlocal profiler
            marks.update(
                server_cpu=proc_cpu_seconds(server.pid), engine_cpu=proc_cpu_seconds(sim.pid),
                self_cpu=self_cpu_seconds(), poller_cpu=poller.cpu_seconds(), rss_kib=proc_kib(server.pid, "VmRSS"),
                engine_io=proc_io(sim.pid), server_sched=proc_schedstat(server.pid), system=system_cpu(),
            )
            if args.profile and not floor:
                profiler = start_profiler(server.pid, args.profile, args.duration)

        res = run_async(run_load(server.url, args, on_start))
        cpu_s = {
            "server": proc_cpu_seconds(server.pid) - marks["server_cpu"],
            "engine": proc_cpu_seconds(sim.pid) - marks["engine_cpu"],
            "loadgen": self_cpu_seconds() - marks["self_cpu"],
            "poller": poller.cpu_seconds() - marks["poller_cpu"],
        }
        engine_wchar = proc_io(sim.pid).get("wchar", 0) - marks["engine_io"].get("wchar", 0)
        server_wait_s = (proc_schedstat(server.pid)[1] - marks["server_sched"][1]) / 1e9
        machine_busy = (system_cpu()[0] - marks["system"][0]) / (res.end - res.start)
        time.sleep(0.2)
        rows = poller.finish()
        rss_kib = {"before": marks["rss_kib"], "peak": proc_kib(server.pid, "VmHWM"),
                   "after": proc_kib(server.pid, "VmRSS")}
        engine_info = httpx.get(f"{sim.url}/server_info", timeout=10).json()
        if profiler is not None:
            _, err = profiler.communicate(timeout=args.duration + 60)
            if profiler.returncode:
                print(f"py-spy failed: {err.decode(errors='replace')[-500:]}", file=sys.stderr)
    finally:
        if poller.proc.is_alive():
            poller.proc.kill()
        server.stop()
        sim.stop()
        os.sched_setaffinity(0, all_cpus())  # the next measurement pins afresh
    return Measurement(
        args=args, pin_note=pin_note, pinning=pinning, probe=probe, res=res, rows=rows, baseline_end=baseline_end,
        cpu_s=cpu_s, server_wait_s=server_wait_s, machine_busy=machine_busy, rss_kib=rss_kib,
        engine_wchar=engine_wchar, engine_info=engine_info,
        logs={"server_log": str(server.log_path), "engine_log": str(sim.log_path)},
        shared_core=loadgen_cpu is not None and loadgen_cpu == engine_cpu,
    )


@dataclass
class Polls:
    """The /health polls split into the idle baseline and the load window."""

    starts: np.ndarray
    lat_ms: np.ndarray
    ok: np.ndarray
    late_ms: np.ndarray
    base: np.ndarray
    under: np.ndarray

    @classmethod
    def of(cls, m: Measurement) -> Polls:
        rows = m.rows
        starts, lat_ms, ok, late_ms = rows[:, 0], rows[:, 1] * 1000, rows[:, 2] > 0, rows[:, 3] * 1000
        # Baseline: idle polls before the warm-up wave, minus the poller's first half second (its own warm-up).
        base = (starts < m.baseline_end) & (starts >= (starts.min() if starts.size else 0.0) + 0.5)
        under = (starts >= m.res.start) & (starts <= m.res.end)
        return cls(starts, lat_ms, ok, late_ms, base, under)


def figures(m: Measurement, polls: Polls) -> Figures:
    """The headline first: chats per server-CPU-second does not depend on how fast the load generator is."""
    res, wall, cpu = m.res, m.wall, m.cpu_s
    chats = len(res.chat_latency_s)
    chat_ms = np.asarray(res.chat_latency_s) * 1000
    figs = Figures()
    figs.add("chats_per_server_cpu_s", chats / cpu["server"] if cpu["server"] > 0 else None, "chats/CPU-s", "higher",
             floor=5.0)
    figs.add("server_cpu_ms_per_chat", 1000 * cpu["server"] / chats if chats else None, "ms", "lower", floor=0.1)
    figs.add("chats_per_s", chats / wall if wall > 0 else 0.0, "chats/s", "higher", floor=2.0)
    chat_phase = float(np.sum(res.chat_phase_s))
    figs.add("chat_phase_chats_per_s", chats / chat_phase if chat_phase else None, "chats/s", "higher", floor=2.0)
    figs.add("chats", chats, "count")
    figs.add("waves", res.waves, "count")
    figs.add("errors", sum(res.errors.values()), "count", "lower")
    for q in (50, 95, 99):
        figs.add(f"chat_latency_p{q}_ms", pct(chat_ms, q), "ms", "lower", floor=2.0)
    figs.add("wave_create_mean_ms", pct(np.asarray(res.create_s) * 1000, 50), "ms", "lower", floor=2.0)
    figs.add("wave_chat_mean_ms", pct(np.asarray(res.chat_phase_s) * 1000, 50), "ms", "lower", floor=2.0)
    figs.add("wave_delete_mean_ms", pct(np.asarray(res.delete_s) * 1000, 50), "ms", "lower", floor=2.0)
    health_figures(figs, "health_load", polls.lat_ms[polls.under])
    health_figures(figs, "health_baseline", polls.lat_ms[polls.base])
    figs.add("health_errors", int((~polls.ok[polls.under | polls.base]).sum()), "count", "lower")
    figs.add("poller_lateness_p99_ms", pct(polls.late_ms[polls.under], 99), "ms", "lower", floor=1.0)
    figs.add("engine_response_bytes", m.probe["bytes"], "bytes", None, floor=1024)
    figs.add("engine_bytes_written_per_chat", m.engine_wchar / chats if chats else None, "bytes", None, floor=4096)
    figs.add("chat_reply_bytes_mean", float(np.mean(res.reply_bytes)) if res.reply_bytes else None, "bytes", None,
             floor=16)
    figs.add("server_cpu_util", cpu["server"] / wall, "cores", None, floor=0.05)
    figs.add("engine_cpu_util", cpu["engine"] / wall, "cores", None, floor=0.05)
    figs.add("loadgen_cpu_util", cpu["loadgen"] / wall, "cores", "lower", floor=0.05)
    figs.add("poller_cpu_util", cpu["poller"] / wall, "cores", None, floor=0.02)
    figs.add("machine_busy_cores", m.machine_busy, "cores", None, floor=0.05)
    figs.add("other_load_cores", max(0.0, m.machine_busy - sum(cpu.values()) / wall), "cores", "lower", floor=0.1)
    figs.add("server_runqueue_wait_frac", m.server_wait_s / wall, "fraction", "lower", floor=0.02)
    figs.add("server_peak_rss_mib", m.rss_kib["peak"] / 1024, "MiB", "lower", floor=8.0)
    figs.add("server_rss_before_load_mib", m.rss_kib["before"] / 1024, "MiB", "lower", floor=8.0)
    figs.add("server_rss_after_load_mib", m.rss_kib["after"] / 1024, "MiB", "lower", floor=8.0)
    return figs


FLOOR_FIGURES = ("server_cpu_ms_per_chat", "chats_per_server_cpu_s", "health_load_p99_ms", "chat_latency_p99_ms",
                 "server_peak_rss_mib")


def add_floor(figs: Figures, floor: Figures) -> None:
    """The floor's figures beside ours (`floor_*`), and our CPU per chat as a multiple of the floor's."""
    for name in FLOOR_FIGURES:
        meta = floor.meta[name]
        figs.add(f"floor_{name}", floor.values[name], meta["unit"], meta["better"], meta["floor"])
    ours, base = figs.values["server_cpu_ms_per_chat"], floor.values["server_cpu_ms_per_chat"]
    figs.add("server_cpu_per_chat_x_floor", ours / base if ours and base else None, "x floor", "lower", floor=0.05)


def limiting_factors(m: Measurement, v: dict[str, Any]) -> list[str]:
    """What held this run back, so a reader knows which figures to trust."""
    limits = []
    if v["other_load_cores"] > 0.25:
        limits.append("OTHER LOAD ON THE MACHINE held the server back: figures are not representative")
    if v["loadgen_cpu_util"] > 0.85:
        limits.append("the Python load generator saturated its core: chats/s is client-bound (chats per "
                      "server-CPU-second is not)")
    if v["engine_cpu_util"] > 0.85:
        limits.append("the emulated engine saturated its core: chats/s is engine-bound")
    if v["server_cpu_util"] > 0.85:
        limits.append("the server saturated its core")
    if m.shared_core:
        limits.append("load generator shares the engine's core")
    return limits


def slow_polls(m: Measurement, polls: Polls) -> list[dict[str, Any]]:
    """The slowest polls under load and the wave phase each started in."""
    under, lat_ms = polls.under, polls.lat_ms
    threshold = max(20.0, float(np.percentile(lat_ms[under], 99)) if under.any() else 20)
    return [{"t": round(float(polls.starts[i] - m.res.start), 3), "ms": round(float(lat_ms[i]), 1),
             "phase": m.res.phase_at(float(polls.starts[i]))} for i in np.flatnonzero(under & (lat_ms > threshold))]


def print_report(m: Measurement, figs: Figures, outliers: list[dict[str, Any]]) -> None:
    args, res, v = m.args, m.res, figs.values
    decode = "inline" if args.inline_decode else "pooled"
    print()
    print(f"session-server responsiveness: K={args.concurrency}, window {m.wall:.1f} s, {res.waves} waves, "
          f"{decode} decode")
    print(f"  pinning         {m.pin_note}: "
          + ", ".join(f"{k} cpus {val}" for k, val in m.pinning.items() if k != "note"))
    print(f"  CAPACITY        {fmt(v['chats_per_server_cpu_s'])} chats per server-CPU-second "
          f"({fmt(v['server_cpu_ms_per_chat'])} ms of server CPU per chat)")
    if v.get("floor_server_cpu_ms_per_chat") is not None:
        print(f"  FLOOR           {fmt(v['floor_server_cpu_ms_per_chat'])} ms of CPU per chat through the floor proxy "
              f"({fmt(v['floor_chats_per_server_cpu_s'])} chats per CPU-second, /health p99 under load "
              f"{fmt(v['floor_health_load_p99_ms'])} ms): the server costs {fmt(v['server_cpu_per_chat_x_floor'])}x "
              "the floor (target <= 1.5x)")
    if v.get("server_cpu_per_chat_x_floor_median") is not None:
        print(f"  PAIRS           the server per chat vs the floor's, pair by pair: "
              f"{', '.join(f'{v[k]:.2f}x' for k in v if k.startswith('server_cpu_per_chat_x_floor_pair'))}; median "
              f"{fmt(v['server_cpu_per_chat_x_floor_median'])}x")
    print(f"  throughput      {v['chats_per_s']:.1f} chats/s ({v['chats']} chats, errors {v['errors']}); "
          f"{fmt(v['chat_phase_chats_per_s'])} chats/s counting only the chat phase of each wave (waves: create "
          f"{fmt(v['wave_create_mean_ms'])} ms, chats {fmt(v['wave_chat_mean_ms'])} ms, delete "
          f"{fmt(v['wave_delete_mean_ms'])} ms)")
    print(f"  chat latency    p50 {fmt(v['chat_latency_p50_ms'])}  p95 {fmt(v['chat_latency_p95_ms'])}  "
          f"p99 {fmt(v['chat_latency_p99_ms'])} ms")
    for prefix, label in (("health_load", "under load"), ("health_baseline", "baseline  ")):
        print(f"  /health {label} p50 {fmt(v[prefix + '_p50_ms'])}  p95 {fmt(v[prefix + '_p95_ms'])}  "
              f"p99 {fmt(v[prefix + '_p99_ms'])}  max {fmt(v[prefix + '_max_ms'])} ms  ({v[prefix + '_polls']} polls)")
    sent = v["engine_bytes_written_per_chat"] or 0
    print(f"  bodies          engine wrote {human_bytes(sent)} per chat (a /generate asking for routed experts: "
          f"{human_bytes(m.probe['bytes'])}), chat reply {human_bytes(v['chat_reply_bytes_mean'] or 0)}")
    if args.routed_experts_bytes and sent < 0.5 * args.routed_experts_bytes:
        print(f"  WARNING         the engine sent {human_bytes(sent)} per chat, not ~{human_bytes(m.probe['bytes'])}: "
              "the server did not ask for `return_routed_experts`, so this run does not measure large responses")
    print(f"  server CPU      {v['server_cpu_util']:.2f} cores busy; peak RSS {v['server_peak_rss_mib']:.0f} MiB")
    print(f"  other CPU       engine {v['engine_cpu_util']:.2f} cores, load generator {v['loadgen_cpu_util']:.2f}, "
          f"poller {v['poller_cpu_util']:.2f} (poller lateness p99 {fmt(v['poller_lateness_p99_ms'])} ms)")
    print(f"  machine         {v['machine_busy_cores']:.2f} cores busy in all, {v['other_load_cores']:.2f} of them "
          f"outside this benchmark; server threads runnable but waiting for a CPU: "
          f"{v['server_runqueue_wait_frac']:.2f} s per s")
    if limits := limiting_factors(m, v):
        print("  NOTE            " + "; ".join(limits))
    if outliers:
        where = Counter(o["phase"] for o in outliers)
        print(f"  slowest polls   {len(outliers)} above max(20 ms, p99), started during: "
              + ", ".join(f"{k} {n}" for k, n in where.most_common()))
    if res.error_samples:
        print("  first errors:\n    " + "\n    ".join(res.error_samples))
    if args.profile and Path(args.profile).exists() and args.profile.endswith(".txt"):
        print("  profile (server, % of samples: own / in stack):")
        for name, own, total in summarize_collapsed(args.profile):
            print(f"    {own:5.1f}% {total:5.1f}%  {name}")


def write_outputs(m: Measurement, figs: Figures, polls: Polls, outliers: list[dict[str, Any]]) -> None:
    args = m.args
    if args.json_out:
        config = {**vars(args), "pinning": m.pinning, "engine_probe": m.probe, "engine_server_info": m.engine_info,
                  **m.logs}
        write_report(args.json_out, "session_responsiveness", config, figs,
                     errors_by_kind=dict(m.res.errors), error_samples=m.res.error_samples, health_outliers=outliers)
    if args.plot:
        v = figs.values
        plot_health(args.plot, polls.lat_ms[polls.base], polls.lat_ms[polls.under],
                    polls.starts[polls.under] - m.res.start,
                    f"GET /health every {args.health_interval_ms:g} ms; K={args.concurrency} chats/wave, "
                    f"{human_bytes(v['engine_bytes_written_per_chat'] or 0)} engine responses, "
                    f"{'inline' if args.inline_decode else 'pooled'} decode, "
                    f"{fmt(v['chats_per_server_cpu_s'])} chats per server-CPU-s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        print(compare(args.compare[0], args.compare[1], args.noise_band))
        return 0
    ratios: list[float] = []
    for pair in range(max(1, args.pairs)):
        floor = None
        if not args.no_floor:
            fm = measure(args, floor=True)
            floor = figures(fm, Polls.of(fm))
            if fm.res.errors.get("chat"):
                print(f"floor proxy: {fm.res.errors['chat']} chats failed: {fm.res.error_samples[:2]}",
                      file=sys.stderr)
        m = measure(args)
        polls = Polls.of(m)
        figs = figures(m, polls)
        if floor is not None:
            add_floor(figs, floor)
            if (ratio := figs.values.get("server_cpu_per_chat_x_floor")) is not None:
                ratios.append(ratio)
                print(f"[pair {pair + 1}/{args.pairs}] the server costs {ratio:.2f}x the floor per chat",
                      file=sys.stderr, flush=True)
    if len(ratios) > 1:
        figs.add("server_cpu_per_chat_x_floor_median", float(np.median(ratios)), "x floor", "lower", floor=0.05)
        for i, ratio in enumerate(ratios):
            figs.add(f"server_cpu_per_chat_x_floor_pair{i + 1}", ratio, "x floor", None)
    outliers = slow_polls(m, polls)
    print_report(m, figs, outliers)
    write_outputs(m, figs, polls, outliers)
    return 1 if m.res.errors.get("chat") or m.res.errors.get("create") else 0


if __name__ == "__main__":
    sys.exit(main())
