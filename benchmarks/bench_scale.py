"""The scale of one process: many live sessions of a few thousand tokens each, and what 64 chatting ones then cost.

Fill: `--sessions` sessions (10,000 by default), each given one turn of about `--session-tokens` tokens (a user
message and a reply; 4096 by default), `--fill-concurrency` at a time. Then, with every session still live, waves of
`-k` (64) concurrent chats -- each the next turn of a different live session, its whole history resent as agents
do -- run for `--duration` seconds while a separate process polls `GET /health` every 10 ms on its own connection.
Reported: the server's RSS before and after the fill (per session and per stored token), its CPU per turn in the
chat phase (schedstat, all threads, so independent of the load generator's speed), `/health` p50/p99/max while
idle with every session live and while the 64 chat, and the same chats' CPU per turn through the floor proxy
(benchmarks/floor_proxy.py) in the same run on the same pinned core, as a multiple.

    python -m benchmarks.bench_scale --tokenizer .cache/tokenizers/qwen3 --json-out out/bench/scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.benchlib import (
    Figures,
    HealthPoller,
    add_stack_args,
    all_cpus,
    fmt,
    parse_stack_args,
    pct,
    pinning_plan,
    proc_kib,
    proc_runtime_ns,
    run_async,
    start_floor,
    start_pair,
    user_message,
    write_report,
)
from harness.launchers import RunningProcess


def fill_message(rng: random.Random, index: int, args: argparse.Namespace) -> dict[str, str]:
    """The first user message of session `index`: most of the session's tokens (a word is about a token; a prompt
    costs the emulated engine less than a reply, so the fill is quicker); an eighth is the reply."""
    reply = args.session_tokens // 8
    return user_message(rng, index, 0, args.session_tokens - reply - 32, reply)


async def fill(client: httpx.AsyncClient, args: argparse.Namespace, keep: set[int]) -> dict[int, Any]:
    """Create and fill every session; the ids (and, for the sessions that chat later, their histories)."""
    rng = random.Random(args.seed)
    sessions: dict[int, Any] = {}
    failed: list[str] = []
    gate = asyncio.Semaphore(args.fill_concurrency)
    done = 0
    t0 = time.monotonic()

    async def one(i: int, message: dict[str, str]) -> None:
        nonlocal done
        async with gate:
            sid = (await client.post("/sessions", json={})).raise_for_status().json()["session_id"]
            body = {"messages": [message], "max_tokens": args.session_tokens, "temperature": 1.0}
            r = await client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
            if r.status_code != 200:  # counted; the session stays live with what it holds (nothing)
                failed.append(f"HTTP {r.status_code} {r.text[:200]}")
                print(f"[scale] fill chat failed: {failed[-1]}", file=sys.stderr, flush=True)
                return
            reply = r.json()["choices"][0]["message"]
            sessions[i] = (sid, [message, {"role": "assistant", "content": reply["content"]}] if i in keep else None)
            done += 1
            if done % 1000 == 0:
                print(f"[scale] filled {done}/{args.sessions} sessions in {time.monotonic() - t0:.0f} s",
                      file=sys.stderr, flush=True)

    await asyncio.gather(*(one(i, fill_message(rng, i, args)) for i in range(args.sessions)))
    sessions[-1] = failed
    return sessions


async def chat_waves(url: str, pid: int, histories: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
                     sent: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Waves of `-k` concurrent chats, each the next turn of a different session (round robin over `histories`,
    which grow by each reply), for --duration seconds: the CPU per turn. The chats are appended to `sent`; with no
    `histories` the chats in `sent` are replayed as they are instead (the floor keeps no history)."""
    rng = random.Random(args.seed + 2)
    replay = not histories
    plan = list(sent) if replay else []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    order = list(histories)
    turns = errors = wave = 0

    def body(sid: str) -> dict[str, Any]:
        history = histories[sid]
        history.append(user_message(rng, order.index(sid), len(history) // 2, 16, args.reply_tokens))
        chat = {"messages": list(history), "max_tokens": 2 * args.reply_tokens, "temperature": 1.0}
        sent.append((sid, chat))
        return chat

    async def one(client: httpx.AsyncClient, sid: str, chat: dict[str, Any]) -> bool:
        r = await client.post(f"/sessions/{sid}/v1/chat/completions", json=chat)
        if r.status_code != 200:
            print(f"[scale] chat failed: HTTP {r.status_code} {r.text[:200]}", file=sys.stderr, flush=True)
            return False
        if not replay:
            message = r.json()["choices"][0]["message"]
            histories[sid].append({"role": "assistant", "content": message["content"]})
        return True

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120.0) as client:
        cpu0 = proc_runtime_ns(pid)
        t0 = time.monotonic()
        while plan[wave * args.concurrency:] if replay else time.monotonic() - t0 < args.duration:
            if replay:
                batch = plan[wave * args.concurrency:(wave + 1) * args.concurrency]
            else:
                sids = [order[(wave * args.concurrency + j) % len(order)] for j in range(args.concurrency)]
                batch = [(sid, body(sid)) for sid in sids]
            ok = await asyncio.gather(*(one(client, sid, chat) for sid, chat in batch))
            turns += sum(ok)
            errors += len(ok) - sum(ok)
            wave += 1
        wall = time.monotonic() - t0
        cpu_ns = proc_runtime_ns(pid) - cpu0
    return {"turns": turns, "errors": errors, "wall_s": wall, "cpu_ms_per_turn": cpu_ns / 1e6 / max(turns, 1),
            "turns_per_s": turns / wall}


def health_ms(rows: np.ndarray) -> dict[str, float | None]:
    ms = rows[:, 1] * 1000 if len(rows) else np.zeros(0)
    return {"p50": pct(ms, 50), "p99": pct(ms, 99), "max": float(ms.max()) if len(ms) else None, "polls": len(ms)}


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    server_cpu, engine_cpu, pin_note = pinning_plan(args.server_cpu, args.engine_cpu)
    engine_args = ["--context-length", str(4 * args.session_tokens), "--kv-capacity-tokens", str(args.engine_kv)]
    sim, server = start_pair(tokenizer=args.tokenizer, family=args.model_family, engine_cpu=engine_cpu,
                             server_cpu=server_cpu, log_dir=log_dir, engine_args=engine_args,
                             server_args=args.server_arg)
    out: dict[str, Any] = {"pinning": pin_note}
    floor: RunningProcess | None = None
    try:
        if engine_cpu is not None:
            os.sched_setaffinity(0, {engine_cpu})  # the load generator shares the engine's core
        chatters = sorted(random.Random(args.seed + 1).sample(range(args.sessions), min(args.sessions,
                                                                                         4 * args.concurrency)))
        rss0 = proc_kib(server.pid, "VmRSS")

        async def fill_all() -> dict[int, Any]:
            n = args.fill_concurrency
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=300.0) as client:
                return await fill(client, args, set(chatters))

        t0 = time.monotonic()
        cpu0 = proc_runtime_ns(server.pid)
        sessions = run_async(fill_all())
        out["fill_errors"] = sessions.pop(-1)
        chatters = [i for i in chatters if i in sessions]
        out["fill_s"] = time.monotonic() - t0
        out["fill_cpu_ms_per_session"] = (proc_runtime_ns(server.pid) - cpu0) / 1e6 / args.sessions
        time.sleep(1.0)  # let the allocator settle before reading RSS
        state = httpx.get(f"{server.url}/sessions/{sessions[chatters[0]][0]}", timeout=30).json()
        out["tokens_per_session"] = len(state.get("token_ids") or (state.get("trajectory") or {}).get("token_ids", []))
        out["rss_before_mib"] = rss0 / 1024
        out["rss_after_mib"] = proc_kib(server.pid, "VmRSS") / 1024
        out["rss_per_session_kib"] = (proc_kib(server.pid, "VmRSS") - rss0) / args.sessions
        out["rss_per_token_bytes"] = out["rss_per_session_kib"] * 1024 / max(out["tokens_per_session"], 1)

        histories = {sessions[i][0]: sessions[i][1] for i in chatters}
        sent: list[tuple[str, dict[str, Any]]] = []
        poller = HealthPoller(server.url, 0.01, engine_cpu)
        poller.start()
        time.sleep(args.idle_seconds)
        idle_until = time.monotonic()
        out["chat"] = run_async(chat_waves(server.url, server.pid, histories, args, sent))
        rows = poller.finish()
        out["health_idle_ms"] = health_ms(rows[rows[:, 0] < idle_until])
        out["health_chat_ms"] = health_ms(rows[rows[:, 0] >= idle_until])
        out["rss_end_mib"] = proc_kib(server.pid, "VmRSS") / 1024
        server.stop()
        if not args.no_floor:  # the same chats through the floor, on the same core, to the same engine
            floor = start_floor(sim.url, cpu=server_cpu, log_dir=log_dir)
            out["floor_chat"] = run_async(chat_waves(floor.url, floor.pid, {}, args, sent))
    finally:
        if floor is not None:
            floor.stop()
        server.stop()
        sim.stop()
        os.sched_setaffinity(0, all_cpus())
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".cache/tokenizers/qwen3")
    p.add_argument("--model-family", default="qwen3")
    p.add_argument("--sessions", type=int, default=10_000, help="live sessions (default %(default)s)")
    p.add_argument("--session-tokens", type=int, default=4096, help="tokens each holds (default %(default)s)")
    p.add_argument("-k", "--concurrency", type=int, default=64, help="sessions chatting at once (default %(default)s)")
    p.add_argument("--reply-tokens", type=int, default=64, help="reply length of the chat phase's turns")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of chat waves (default %(default)s)")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="/health polled idle before the chats")
    p.add_argument("--fill-concurrency", type=int, default=32)
    p.add_argument("--engine-kv", type=int, default=1_000_000, help="the emulated engine's KV tokens (it evicts)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor proxy's run")
    p.add_argument("--seed", type=int, default=0)
    add_stack_args(p)
    return parse_stack_args(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-scale-"))
    m = measure(args, log_dir)
    chat, floor = m["chat"], m.get("floor_chat")
    x_floor = chat["cpu_ms_per_turn"] / floor["cpu_ms_per_turn"] if floor else None
    figs = Figures()
    figs.add("rss_after_fill_mib", m["rss_after_mib"], "MiB", "lower", floor=1.0)
    figs.add("rss_per_session_kib", m["rss_per_session_kib"], "KiB", "lower", floor=1.0)
    figs.add("rss_per_token_bytes", m["rss_per_token_bytes"], "B", "lower", floor=0.5)
    figs.add("cpu_ms_per_turn", chat["cpu_ms_per_turn"], "ms", "lower", floor=0.05)
    if floor:
        figs.add("floor_cpu_ms_per_turn", floor["cpu_ms_per_turn"], "ms", "lower", floor=0.05)
        figs.add("cpu_per_turn_x_floor", x_floor, "x floor", "lower", floor=0.1)
    figs.add("health_p99_ms_chatting", m["health_chat_ms"]["p99"], "ms", "lower", floor=1.0)
    figs.add("health_p99_ms_idle", m["health_idle_ms"]["p99"], "ms", "lower", floor=1.0)
    print()
    print(f"{args.sessions} live sessions of ~{m['tokens_per_session']} tokens in one process, {args.concurrency} "
          f"chatting ({m['pinning']}; filled in {m['fill_s']:.0f} s, {m['fill_cpu_ms_per_session']:.2f} ms server "
          "CPU per session)")
    print("| figure | value |")
    print("|---|---:|")
    print(f"| server RSS before / after the fill | {m['rss_before_mib']:.0f} / {m['rss_after_mib']:.0f} MiB |")
    print(f"| RSS per live session | {m['rss_per_session_kib']:.0f} KiB ({m['rss_per_token_bytes']:.1f} B per token) |")
    print(f"| server CPU per turn, {args.concurrency} chatting | {fmt(chat['cpu_ms_per_turn'])} ms "
          f"({chat['turns']} turns, {chat['turns_per_s']:.0f}/s, {chat['errors']} errors) |")
    if floor:
        print(f"| floor CPU per turn, same chats | {fmt(floor['cpu_ms_per_turn'])} ms (x floor: {fmt(x_floor)}) |")
    for name, key in (("idle", "health_idle_ms"), (f"{args.concurrency} chatting", "health_chat_ms")):
        h = m[key]
        print(f"| /health p50 / p99 / max, {name} | {fmt(h['p50'])} / {fmt(h['p99'])} / {fmt(h['max'])} ms "
              f"({h['polls']} polls) |")
    if args.json_out:
        write_report(args.json_out, "scale", vars(args), figs, results=m)
    if m["fill_errors"]:
        print(f"{len(m['fill_errors'])} fill chats failed, e.g. {m['fill_errors'][0]}")
    return 1 if chat["errors"] or m["fill_errors"] or (floor and floor["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
