"""Past one process: chats per server-CPU-second for 1 replica vs N replicas behind nginx, on the same load.

The machine has few cores, so wall-clock throughput says little; what scale-out must not cost is CPU. The same load
(`--sessions` concurrent sessions, `--turns` chats each, a growing history, short replies from an emulated engine at
zero latency) runs against: one replica directly (no balancer), one replica behind nginx, and N replicas behind
nginx; and 1/N of it against one replica behind nginx, which is what each of the N carries (a replica serving fewer
concurrent chats amortises less per event-loop pass, so this, not the full load, is the fair per-replica reference).
Each replica's CPU (schedstat, all threads) and nginx's (master and workers) are read before and after, so the figures
are chats per replica-CPU-second (should not drop from 1 to N: no cross-replica work) and nginx's CPU per
chat (the balancer's own price, paid once per request whatever N is).

    python -m benchmarks.bench_cluster --tokenizer .cache/tokenizers/qwen3 --replicas 3 --sessions 48 --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.benchlib import Figures, proc_runtime_ns, write_report
from harness.launchers import RunningProcess, start_sim
from harness.nginx_cluster import LocalCluster
from sglang_sim.directives import tokens


def nginx_pids(nginx: RunningProcess) -> list[int]:
    """The master and its workers (the workers do the proxying)."""
    children = Path(f"/proc/{nginx.pid}/task/{nginx.pid}/children").read_text().split()
    return [nginx.pid, *map(int, children)]


def cpu_ns(pids: list[int]) -> int:
    return sum(proc_runtime_ns(pid) for pid in pids)


async def drive(base: str, sessions: int, turns: int, reply_tokens: int) -> tuple[int, int, float]:
    """`sessions` episodes at once, `turns` chats each, through `base`; returns (chats ok, failures, seconds)."""
    ok = failed = 0
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def episode(i: int) -> None:
            nonlocal ok, failed
            r = await http.post(f"{base}/sessions", json={})
            if r.status_code != 200:
                failed += 1
                return
            sid = r.json()["session_id"]
            history: list[dict[str, Any]] = [{"role": "system", "content": f"episode {i}"}]
            for turn in range(turns):
                history.append({"role": "user", "content": f"turn {turn} {tokens(reply_tokens)}"})
                r = await http.post(f"{base}/sessions/{sid}/v1/chat/completions", json={"messages": history})
                if r.status_code != 200:
                    failed += 1
                    return
                ok += 1
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            await http.delete(f"{base}/sessions/{sid}")

        started = time.perf_counter()
        await asyncio.gather(*(episode(i) for i in range(sessions)))
        return ok, failed, time.perf_counter() - started


def measure(c: LocalCluster, base: str, args: argparse.Namespace, through_nginx: bool,
            sessions: int | None = None) -> dict[str, float]:
    """The best of `--repeat` runs of the load (`sessions` at once, default `--sessions`) through `base`."""
    sessions = sessions or args.sessions
    assert c.nginx is not None
    replicas = [p.pid for p in c.procs.values()]
    balancer = nginx_pids(c.nginx)
    asyncio.run(drive(base, min(8, args.sessions), 2, args.reply_tokens))  # warm-up: connections, caches
    idle0 = cpu_ns(replicas)
    time.sleep(args.idle_seconds)  # what the replicas cost doing nothing (tickers, probes), per second
    idle_per_s = (cpu_ns(replicas) - idle0) / 1e9 / args.idle_seconds
    best: dict[str, float] = {}
    for _ in range(args.repeat):  # the best of a few runs: the least disturbed by the rest of the machine
        r0, n0 = cpu_ns(replicas), cpu_ns(balancer)
        chats, failed, seconds = asyncio.run(drive(base, sessions, args.turns, args.reply_tokens))
        replica_s, nginx_s = (cpu_ns(replicas) - r0) / 1e9, (cpu_ns(balancer) - n0) / 1e9
        if failed:
            raise RuntimeError(f"{failed} chats failed through {base}")
        busy_s = replica_s - idle_per_s * seconds
        run = {"chats": chats, "seconds": seconds, "replica_cpu_s": replica_s,
               "chats_per_replica_cpu_s": chats / replica_s, "idle_cpu_ms_per_s": idle_per_s * 1e3,
               "chats_per_busy_cpu_s": chats / busy_s,
               "nginx_cpu_us_per_chat": nginx_s / chats * 1e6 if through_nginx else 0.0}
        if run["chats_per_replica_cpu_s"] > best.get("chats_per_replica_cpu_s", 0.0):
            best = run
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, default=Path(".cache/tokenizers/qwen3"))
    p.add_argument("--family", default="qwen3")
    p.add_argument("--replicas", type=int, default=3, help="N (default 3)")
    p.add_argument("--sessions", type=int, default=48, help="concurrent sessions (default 48)")
    p.add_argument("--turns", type=int, default=8, help="chats per session (default 8)")
    p.add_argument("--reply-tokens", type=int, default=16, help="tokens per reply (default 16)")
    p.add_argument("--repeat", type=int, default=3, help="runs per setup, the best kept (default 3)")
    p.add_argument("--idle-seconds", type=float, default=3.0,
                   help="seconds the idle replicas are measured, to tell their idle cost apart (default 3)")
    p.add_argument("--json-out", default="out/bench/cluster.json")
    args = p.parse_args(argv)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        sim = start_sim(args.tokenizer, args.family, log_path=Path(tmp) / "sim.log")
        try:
            for n in (1, args.replicas):
                c = LocalCluster([sim.url], args.tokenizer, args.family, Path(tmp) / f"n{n}", journal=False)
                try:
                    c.start(n)
                    if n == 1:
                        rows["1 replica, direct"] = measure(c, c.replica_url("r0"), args, through_nginx=False)
                    rows[f"{n} replica{'s' if n > 1 else ''}, nginx"] = measure(c, c.url, args, through_nginx=True)
                    if n == 1:  # what one of the N replicas carries: tells concurrency effects from cross-replica cost
                        rows[f"1 replica, nginx, 1/{args.replicas}"] = measure(
                            c, c.url, args, through_nginx=True, sessions=max(1, args.sessions // args.replicas))
                finally:
                    failures = c.close()
                if failures:
                    print("\n".join(failures), file=sys.stderr)
                    return 1
        finally:
            sim.stop()
    print(f"{'setup':<22} {'chats':>6} {'wall s':>7} {'replica CPU s':>14} {'chats/replica-CPU-s':>20} "
          f"{'idle CPU ms/s':>14} {'chats/busy-CPU-s':>17} {'nginx us/chat':>14}")
    for name, r in rows.items():
        print(f"{name:<22} {r['chats']:>6.0f} {r['seconds']:>7.2f} {r['replica_cpu_s']:>14.2f} "
              f"{r['chats_per_replica_cpu_s']:>20.0f} {r['idle_cpu_ms_per_s']:>14.1f} "
              f"{r['chats_per_busy_cpu_s']:>17.0f} {r['nginx_cpu_us_per_chat']:>14.0f}")
    one, many = rows["1 replica, nginx"], rows[f"{args.replicas} replicas, nginx"]
    ratio = many["chats_per_replica_cpu_s"] / one["chats_per_replica_cpu_s"]
    busy_ratio = many["chats_per_busy_cpu_s"] / one["chats_per_busy_cpu_s"]
    share = rows[f"1 replica, nginx, 1/{args.replicas}"]
    share_ratio = many["chats_per_busy_cpu_s"] / share["chats_per_busy_cpu_s"]
    print(f"chats per replica-CPU-second, {args.replicas} replicas / 1 replica: {ratio:.2f}x; idle cost taken out: "
          f"{busy_ratio:.2f}x; against 1 replica carrying 1/{args.replicas} of the load: {share_ratio:.2f}x "
          "(1.00x: no cross-replica overhead)")
    figures = Figures()
    for name, r in rows.items():
        key = name.replace(", ", "_").replace(" ", "_")
        figures.add(f"{key}_chats_per_replica_cpu_s", r["chats_per_replica_cpu_s"], "chats/CPU-s", "higher")
        figures.add(f"{key}_chats_per_busy_cpu_s", r["chats_per_busy_cpu_s"], "chats/CPU-s", "higher")
        figures.add(f"{key}_nginx_us_per_chat", r["nginx_cpu_us_per_chat"], "us", "lower")
    figures.add("n_over_1_ratio", ratio, "x", "higher")
    figures.add("n_over_1_busy_ratio", busy_ratio, "x", "higher")
    figures.add("n_over_1_share_ratio", share_ratio, "x", "higher")
    write_report(args.json_out, "cluster", vars(args) | {"tokenizer": str(args.tokenizer)}, figures, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
