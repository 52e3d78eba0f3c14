"""The GRPO burst: hundreds of episodes open at once, one turn each, some clients vanish mid-reply, then every session
is deleted -- with and without --engine-sessions (issue 43).

An RL step begins and ends with a burst. With engine sessions each first turn adds an `/open_session` and each DELETE
a `/close_session` (and the aborts of the vanished clients' requests); those control calls must not queue behind
each other or behind generation, must not time out, and a DELETE must not wait for the engine. Per configuration
and size the benchmark reports:

- burst_s: from the first chat sent to the last answered (or abandoned); chat_p99_ms; chats by status;
- cleanup_s: the DELETEs, one after another as a trainer's loop sends them, and delete_p99_ms;
- settle_s: from the last DELETE until the engine's books are back at zero (no open engine session, nothing running;
  what the background closes and aborts still had to do);
- control_timeouts: control calls (open, close, abort) that did not answer within their deadline, from the server's
  `engine_control_failures_total` (older servers: their log's warnings);
- fallbacks: turns sent without their engine session; the engine's books at the end (after a cache flush).

Goal (docs/benchmarks.md): with engine sessions, burst + cleanup at most 1.2x the time without them, no control-call
timeout on a quiet machine, DELETE p99 under 10 ms. The load average is reported with the figures: other work on
the machine moves them.

    python -m benchmarks.bench_burst --tokenizer .cache/tokenizers/qwen3 --sessions 300 1000 --json-out out/burst.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks.benchlib import (
    Figures,
    add_stack_args,
    parse_stack_args,
    pct,
    pinning_plan,
    proc_cpu_seconds,
    run_async,
    self_cpu_seconds,
    start_pair,
    write_report,
)
from harness.launchers import RunningProcess
from sglang_sim import directives

CONFIGS = {"plain": [], "engine_sessions": ["--engine-sessions"]}
SETTLE_LIMIT = 120.0  # seconds to wait for the engine's books after the DELETEs, before reporting them as they are
_TIMEOUT_LINES = re.compile(r"did not answer within|timed out")


def user_message(i: int, turn: int, reply_tokens: int) -> dict[str, str]:
    return {"role": "user", "content": f"episode {i} turn {turn}: solve the task {directives.tokens(reply_tokens)}"}


def chat_body(messages: list[dict[str, str]], reply_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": reply_tokens + 8}


class Episode:
    """One agent's own keep-alive connection to the server (a raw HTTP/1.1 client: with a thousand at once a pooled
    client's own CPU would spread the burst out before it reaches the server, and the burst is what is measured)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        if self._conn is None:
            self._conn = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._conn
        payload = b"" if body is None else json.dumps(body).encode()
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            data = await reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            self.close()  # cancelled mid-reply: the connection goes, as a vanished client's does
            raise
        if headers.get("connection", "").lower() == "close":
            self.close()
        return int(lines[0].split()[1]), data

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


async def run_burst(server: str, engine: str, n: int, vanish: int, reply_tokens: int, token_ms: float,
                    seed: int, pids: tuple[int, int], turns: int = 1) -> dict[str, Any]:
    """One burst against a running pair: create n sessions, chat `turns` times each, every turn a burst of its own
    (`vanish` clients cancel mid-reply in the first and are gone after it), then DELETE them one after another, then
    wait for the engine's books to settle."""
    rng = random.Random(seed)
    vanishing = set(rng.sample(range(n), vanish))
    reply_s = reply_tokens * token_ms / 1000.0
    episodes = [Episode(server) for _ in range(n)]
    sem = asyncio.Semaphore(64)

    async def create(ep: Episode) -> str:
        async with sem:
            status, body = await ep.request("POST", "/sessions")
            assert status == 200, body
            return str(json.loads(body)["session_id"])

    sids = await asyncio.gather(*(create(ep) for ep in episodes))
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    histories: list[list[dict[str, str]]] = [[] for _ in range(n)]
    gone: set[int] = set(vanishing)

    async def chat(i: int, sid: str, turn: int) -> None:
        if turn > 0 and i in gone:  # vanished, or its previous turn failed: the episode is over
            return
        t0 = time.perf_counter()
        histories[i].append(user_message(i, turn, reply_tokens))
        request = episodes[i].request("POST", f"/sessions/{sid}/v1/chat/completions",
                                      chat_body(histories[i], reply_tokens))
        if i in vanishing and turn == 0:  # the client goes away partway through its reply
            try:
                await asyncio.wait_for(request, timeout=rng.uniform(0.2, 0.8) * reply_s)
                statuses["finished_before_vanishing"] += 1
            except TimeoutError:
                statuses["vanished"] += 1
            return
        try:
            status, body = await request
            statuses[str(status)] += 1
        except (OSError, asyncio.IncompleteReadError) as exc:
            statuses[type(exc).__name__] += 1
            status, body = 0, b""
        latencies.append(time.perf_counter() - t0)
        if status == 200:
            histories[i].append({"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"]})
        else:
            gone.add(i)

    cpu0 = [proc_cpu_seconds(pid) for pid in pids] + [self_cpu_seconds()]
    burst_s = 0.0
    for turn in range(turns):  # the group's turns in lockstep: each a burst (the trainer waits for the slowest)
        t0 = time.perf_counter()
        await asyncio.gather(*(chat(i, sid, turn) for i, sid in enumerate(sids)))
        burst_s += time.perf_counter() - t0
    cpu = [b - a for a, b in zip(cpu0, [*(proc_cpu_seconds(pid) for pid in pids), self_cpu_seconds()], strict=True)]
    delete_lat: list[float] = []
    delete_status: Counter[int] = Counter()
    trainer = Episode(server)  # the trainer's one connection: it deletes the group's sessions one after another
    t1 = time.perf_counter()
    for sid in sids:
        d0 = time.perf_counter()
        status, _ = await trainer.request("DELETE", f"/sessions/{sid}")
        delete_lat.append(time.perf_counter() - d0)
        delete_status[status] += 1
    cleanup_s = time.perf_counter() - t1
    for ep in episodes:
        ep.close()
    async with httpx.AsyncClient(timeout=120.0) as http:
        t2 = time.perf_counter()
        books = await settled_books(http, engine)
        settle_s = time.perf_counter() - t2
        metrics = (await http.get(f"{server}/metrics")).text
        closes = (await http.get(f"{engine}/sim/hold_closes")).json()["received"]
    trainer.close()
    return {"burst_cpu_s": dict(zip(("server", "engine", "client"), cpu, strict=True)), "burst_s": burst_s,
            "cleanup_s": cleanup_s, "settle_s": settle_s, "chat_latencies": latencies, "statuses": dict(statuses),
            "delete_latencies": delete_lat, "delete_statuses": dict(delete_status), "books": books,
            "metrics": metrics, "engine_closes": closes}


async def settled_books(http: httpx.AsyncClient, engine: str) -> dict[str, Any]:
    """The engine's books once nothing runs and no engine session is open (or as they are after SETTLE_LIMIT s), and
    KV in use after a cache flush (what no request or session holds is then free)."""
    deadline = time.monotonic() + SETTLE_LIMIT
    while True:
        info = (await http.get(f"{engine}/server_info")).json()
        idle = info["open_sessions"] == 0 and info["running_requests"] == 0 and info["waiting_requests"] == 0
        if idle or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    await http.post(f"{engine}/flush_cache")
    info = (await http.get(f"{engine}/server_info")).json()
    return {k: info[k] for k in ("open_sessions", "running_requests", "waiting_requests", "kv_used_tokens",
                                 "kv_session_tokens")}


def metric_sum(text: str, name: str, label: str | None = None) -> float | None:
    """The sum of a metric's series in Prometheus text (those whose labels contain `label`), None when absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and (label is None or label in line):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def control_timeouts(metrics: str, server: RunningProcess, lines_before: int) -> int:
    """Control calls that did not answer in time: the server's counter, or its log's warnings (older servers)."""
    counted = metric_sum(metrics, "session_server_engine_control_failures_total", 'kind="timeout"')
    if counted is not None:
        return int(counted)
    return sum(1 for line in server.output[lines_before:] if _TIMEOUT_LINES.search(line))


def measure(args: argparse.Namespace, config: str, n: int, figures: Figures, log_dir: Path | None) -> dict[str, Any]:
    engine_args = ["--enable-streaming-session", "--token-latency-ms", str(args.token_ms),
                   "--kv-capacity-tokens", str(max(65536, n * args.kv_per_session * args.turns))]
    server_args = [*CONFIGS[config], "--request-timeout", str(args.request_timeout), *args.server_arg]
    server_cpu, engine_cpu, _ = pinning_plan(args.server_cpu, args.engine_cpu)
    sim, server = start_pair(tokenizer=args.tokenizer, family=args.family, engine_cpu=engine_cpu,
                             server_cpu=server_cpu, log_dir=log_dir, engine_args=engine_args, server_args=server_args,
                             server_src=args.server_src)
    try:
        lines_before = len(server.output)
        load = os.getloadavg()[0]
        vanish = round(n * args.vanish_fraction)
        res = run_async(run_burst(server.url, sim.url, n, vanish, args.reply_tokens, args.token_ms, args.seed,
                                  (server.pid, sim.pid), args.turns))
    finally:
        server.stop()
        sim.stop()
    tag = f"{config}.n{n}"
    metrics = res["metrics"]
    timeouts = control_timeouts(metrics, server, lines_before)
    fallbacks = metric_sum(metrics, "session_server_engine_session_fallbacks_total") or 0
    answered = sum(v for k, v in res["statuses"].items() if k == "200")
    figures.add(f"{tag}.burst_s", res["burst_s"], "s", "lower", 0.2)
    figures.add(f"{tag}.cleanup_s", res["cleanup_s"], "s", "lower", 0.2)
    figures.add(f"{tag}.burst_and_cleanup_s", res["burst_s"] + res["cleanup_s"], "s", "lower", 0.2)
    figures.add(f"{tag}.settle_s", res["settle_s"], "s", "lower", 0.2)
    figures.add(f"{tag}.chat_p99_ms", 1000 * (pct(res["chat_latencies"], 99) or 0), "ms", "lower", 50)
    figures.add(f"{tag}.delete_p50_ms", 1000 * (pct(res["delete_latencies"], 50) or 0), "ms", "lower", 1)
    figures.add(f"{tag}.delete_p99_ms", 1000 * (pct(res["delete_latencies"], 99) or 0), "ms", "lower", 2)
    figures.add(f"{tag}.chats_200", answered, "chats", "higher")
    figures.add(f"{tag}.chats_failed", sum(res["statuses"].values()) - answered - res["statuses"].get("vanished", 0)
                - res["statuses"].get("finished_before_vanishing", 0), "chats", "lower")
    figures.add(f"{tag}.control_timeouts", timeouts, "calls", "lower")
    figures.add(f"{tag}.fallbacks", fallbacks, "turns", "lower")
    figures.add(f"{tag}.engine_closes", res["engine_closes"], "calls", "lower")
    figures.add(f"{tag}.engine_open_sessions_end", res["books"]["open_sessions"], "sessions", "lower")
    figures.add(f"{tag}.engine_kv_used_end", res["books"]["kv_used_tokens"], "tokens", "lower")
    figures.add(f"{tag}.loadavg_1m", load, "load")
    for who, seconds in res["burst_cpu_s"].items():
        figures.add(f"{tag}.burst_cpu_{who}_s", seconds, "CPU s", "lower", 0.1)
    cpu = " ".join(f"{who} {seconds:.2f}s" for who, seconds in res["burst_cpu_s"].items())
    print(f"{tag:24} load {load:4.1f}  burst {res['burst_s']:6.2f}s  cleanup {res['cleanup_s']:6.2f}s  "
          f"settle {res['settle_s']:5.2f}s  chat p99 {figures.values[f'{tag}.chat_p99_ms']:7.0f}ms  "
          f"DELETE p99 {figures.values[f'{tag}.delete_p99_ms']:6.1f}ms  control timeouts {timeouts}  "
          f"fallbacks {fallbacks:g}  closes {res['engine_closes']}  burst CPU {cpu}  chats {res['statuses']}  "
          f"deletes {res['delete_statuses']}  "
          f"books {res['books']}")
    return {"statuses": res["statuses"], "delete_statuses": res["delete_statuses"], "books": res["books"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".cache/tokenizers/qwen3")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--sessions", type=int, nargs="+", default=[300, 1000])
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    p.add_argument("--turns", type=int, default=1,
                   help="turns per episode, each a burst of the group's chats (1: GRPO; 2: the engine sessions open)")
    p.add_argument("--reply-tokens", type=int, default=150)
    p.add_argument("--token-ms", type=float, default=2.0, help="the sim's latency per token")
    p.add_argument("--vanish-fraction", type=float, default=0.1, help="clients that go away mid-reply")
    p.add_argument("--request-timeout", type=float, default=4.0)
    p.add_argument("--kv-per-session", type=int, default=400, help="KV tokens the sim gets per session")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-src", default=None,
                   help="run the session server from this source tree (`git archive COMMIT | tar -x -C DIR`): before")
    add_stack_args(p)
    args = parse_stack_args(p, argv)
    log_dir = Path(args.log_dir) if args.log_dir else None
    figures = Figures()
    runs: dict[str, Any] = {}
    for n in args.sessions:
        for config in args.configs:
            runs[f"{config}.n{n}"] = measure(args, config, n, figures, log_dir)
    for n in args.sessions:
        plain, es = (figures.values.get(f"{c}.n{n}.burst_and_cleanup_s") for c in ("plain", "engine_sessions"))
        if isinstance(plain, float) and isinstance(es, float) and plain > 0:
            figures.add(f"n{n}.engine_sessions_over_plain", es / plain, "x", "lower", 0.05)
            print(f"n={n}: burst + cleanup with engine sessions {es / plain:.2f}x the time without (goal <= 1.2x)")
    if args.json_out:
        write_report(args.json_out, "bench_burst", {k: v for k, v in vars(args).items() if k != "json_out"},
                     figures, runs=runs)


if __name__ == "__main__":
    main()
