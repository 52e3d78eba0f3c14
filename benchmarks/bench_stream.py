"""What streaming costs: the session server's CPU for a streamed reply against the same reply unstreamed.

For each reply length (1k/4k/16k/32k tokens by default) and each engine streaming mode -- SGLang's default cumulative
events and `--incremental-streaming-output` deltas (the server then runs with `--engine-incremental-streaming`) -- the
emulated engine streams one event per token (`--stream-interval 1`, SGLang's default), and the benchmark asks the
server for the same one-turn reply with `stream: false` and with `stream: true`, alternately, `--reps` times each. The
server's CPU per chat is its schedstat runtime across the chat (ns, all threads), so the figure does not depend on the
benchmark's own speed; the ratio streamed / unstreamed is the goal of docs/design.md 7 (at most 2 at 16k and 32k tokens,
in both modes). The floor (benchmarks/floor_proxy.py: uvicorn + Starlette + our engine client relaying the same chats,
each engine event decoded and relayed as a chunk) is measured the same way, in the same run, on the same core.

The engine is configured for one event per token; the server asks each streamed request for its own
`stream_interval` (session_server/engine/pacing.py: DELTA_INTERVAL tokens per delta event, max_tokens/8 but at least
64 per cumulative event, since a cumulative stream of n tokens at one event per token puts about n^2/2 tokens on the
wire, ~21 GB for 32k tokens), and the floor asks the same. `--engine-stream-interval N` makes both ask for N tokens
per event (1: every token, the per-token stream; cumulative replies of 16k tokens and more then do not finish in
reasonable time). A chat that does not finish within `--chat-timeout` is reported as such; the table gives the
interval asked for, the chunks the agent got and the largest gap between two of its text chunks, in tokens (the
reply retokenized) and in ms (with an unpaced engine the ms say how fast the server relays, not how fast a GPU
decodes; `--engine-arg=--token-latency-ms --engine-arg=20` paces it).

`--paced` measures at a real engine's pace instead: the sim decodes at `--pace-ms` (0.5 ms) a token, so the events
the server asks for (32 tokens, a delta engine by default) come ~16 ms apart, as on a GPU, and the agent's chunks
go by time (engine/pacing.py: one per 200 ms by default); by default 16k and 32k tokens of deltas. There a streamed
reply pays per chunk, not per byte, and the goal is the same (at most 2x the plain reply's server CPU).

    python -m benchmarks.bench_stream --tokenizer .cache/tokenizers/qwen3 --json-out out/bench/stream.json
    python -m benchmarks.bench_stream --tokenizer .cache/tokenizers/qwen3 --paced --reps 3
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from benchmarks.benchlib import (
    Figures,
    add_stack_args,
    affinity,
    all_cpus,
    fmt,
    parse_stack_args,
    pinning_plan,
    proc_io,
    proc_runtime_ns,
    run_async,
    start_floor,
    start_pair,
    write_report,
)
from harness.launchers import RunningProcess
from session_server.engine.pacing import stream_interval
from sglang_sim import directives

MODES = ("cumulative", "deltas")


def chat_body(tokens: int, stream: bool, rep: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Reply {rep}: {directives.tokens(tokens)}"}],
            "max_tokens": tokens + 16, "temperature": 1.0, "stream": stream}


async def one_chat(client: httpx.AsyncClient, pid: int, engine_pid: int, body: dict[str, Any],
                   limit_s: float) -> dict[str, Any]:
    """One chat on a fresh session: the server's CPU across it, the engine's bytes written, what came back (for a
    stream: when each chunk that carried text arrived and how many characters of text it carried)."""
    sid = (await client.post("/sessions", json={})).json()["session_id"]
    url = f"/sessions/{sid}/v1/chat/completions"
    wchar0 = proc_io(engine_pid).get("wchar", 0)
    cpu0 = proc_runtime_ns(pid)
    t0 = time.perf_counter()
    chunks = 0
    status = 0
    error = None
    arrivals: list[tuple[float, int]] = []  # (seconds since the request, characters of text) per text chunk
    text = ""
    try:
        if body["stream"]:
            async with client.stream("POST", url, json=body, timeout=limit_s) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    chunks += 1
                    if line.startswith("data: [DONE]"):
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    delta = choices[0].get("delta") or {}
                    piece = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
                    if piece:
                        arrivals.append((time.perf_counter() - t0, len(piece)))
                        text += piece
        else:
            r = await client.post(url, json=body, timeout=limit_s)
            status = r.status_code
    except httpx.TimeoutException:
        error = f"did not finish within {limit_s:g} s"
    wall = time.perf_counter() - t0
    cpu_ns = proc_runtime_ns(pid) - cpu0
    await client.delete(f"/sessions/{sid}")
    if error is None and status != 200:
        error = f"HTTP {status}"
    return {"cpu_ms": cpu_ns / 1e6, "wall_s": wall, "chunks": chunks, "error": error,
            "engine_bytes": proc_io(engine_pid).get("wchar", 0) - wchar0, "arrivals": arrivals, "text": text}


def gaps(arrivals: list[tuple[float, int]], text: str, tokenizer: Any) -> dict[str, Any]:
    """The largest gap between two text chunks the agent got, in tokens and in ms, and the text chunks. Tokens are
    counted by the reply's text retokenized (a chunk ends at a character offset; the tokens that end there or
    before it are the ones the agent has seen), which is the engine's own tokenization for the sim's words."""
    if not arrivals:
        return {"text_chunks": 0, "max_gap_tokens": None, "max_gap_ms": None}
    ends = [end for _, end in tokenizer.encode(text, add_special_tokens=False).offsets]
    seen = 0
    chars = 0
    worst_tokens = 0
    worst_ms = 0.0
    previous = arrivals[0][0]
    for t, n in arrivals:
        chars += n
        now = bisect.bisect_right(ends, chars)
        worst_tokens = max(worst_tokens, now - seen)
        worst_ms = max(worst_ms, (t - previous) * 1000)
        seen, previous = now, t
    return {"text_chunks": len(arrivals), "max_gap_tokens": worst_tokens, "max_gap_ms": worst_ms,
            "first_chunk_tokens": bisect.bisect_right(ends, arrivals[0][1])}


async def measure(url: str, pid: int, engine_pid: int, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    async with httpx.AsyncClient(base_url=url, timeout=args.chat_timeout) as client:
        await one_chat(client, pid, engine_pid, chat_body(64, True, -1), args.chat_timeout)  # warm-up
        await one_chat(client, pid, engine_pid, chat_body(64, False, -1), args.chat_timeout)
        for tokens in args.tokens:
            rows: dict[str, list[dict[str, Any]]] = {"plain": [], "streamed": []}
            for rep in range(args.reps):
                for kind in ("plain", "streamed"):
                    row = await one_chat(client, pid, engine_pid, chat_body(tokens, kind == "streamed", rep),
                                         args.chat_timeout)
                    row.update(gaps(row.pop("arrivals"), row.pop("text"), tokenizer))
                    rows[kind].append(row)
                    print(f"[stream] {tokens} tokens {kind}: {row['cpu_ms']:.1f} ms CPU, {row['wall_s']:.2f} s, "
                          f"engine wrote {row['engine_bytes'] / 2**20:.1f} MiB"
                          + (f", {row['text_chunks']} text chunks, largest gap {row['max_gap_tokens']} tokens "
                             f"{row['max_gap_ms']:.1f} ms" if row["text_chunks"] else "")
                          + (f" ERROR {row['error']}" if row["error"] else ""), file=sys.stderr, flush=True)
                if any(r["error"] for r in rows["streamed"]):
                    break  # a stream that times out will not finish faster the second time
            out[tokens] = {kind: {
                "cpu_ms": statistics.median(r["cpu_ms"] for r in rs),
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "engine_mib": statistics.median(r["engine_bytes"] for r in rs) / 2**20,
                "chunks": rs[-1]["chunks"], "errors": [r["error"] for r in rs if r["error"]],
                "text_chunks": rs[-1]["text_chunks"],
                "max_gap_tokens": max((r["max_gap_tokens"] or 0 for r in rs), default=None),
                "max_gap_ms": max((r["max_gap_ms"] or 0.0 for r in rs), default=None),
            } for kind, rs in rows.items()}
    return out


def run_mode(mode: str, args: argparse.Namespace, cpus: tuple[int | None, int | None], log_dir: Path,
             floor: bool) -> dict[int, dict[str, Any]]:
    server_cpu, engine_cpu = cpus
    context = max(args.tokens) + 4096
    engine_args = ["--stream-interval", "1", "--context-length", str(context),
                   "--kv-capacity-tokens", str(4 * context), *args.engine_arg]
    if args.paced:
        engine_args += ["--token-latency-ms", str(args.pace_ms)]
    floor_flags = ["--engine-stream-interval", str(args.engine_stream_interval)]
    # 0 leaves the choice to the server; -1 asks nothing of the engine (its own interval, 1), as a --server-src
    # tree from before the flag does
    server_args = [*args.server_arg, *(floor_flags if args.engine_stream_interval > 0 else [])]
    if mode == "deltas":
        engine_args.append("--incremental-streaming-output")
        server_args.append("--engine-incremental-streaming")
    sim, server = start_pair(tokenizer=args.tokenizer, family=args.model_family, engine_cpu=engine_cpu,
                             server_cpu=server_cpu, log_dir=log_dir, engine_args=engine_args,
                             server_args=server_args, server_src=args.server_src)
    proc: RunningProcess = server
    try:
        if floor:
            server.stop()
            proc = start_floor(sim.url, *floor_flags, *(["--engine-incremental-streaming"] if mode == "deltas" else []),
                               cpu=server_cpu, log_dir=log_dir)
        if engine_cpu is not None:
            os.sched_setaffinity(0, {engine_cpu})  # the driver shares the engine's core
        print(f"[stream] {mode}{' (floor)' if floor else ''}: server cpus {affinity(proc.pid)}, "
              f"engine cpus {affinity(sim.pid)}", file=sys.stderr, flush=True)
        return run_async(measure(proc.url, proc.pid, sim.pid, args))
    finally:
        proc.stop()
        server.stop()
        sim.stop()
        os.sched_setaffinity(0, all_cpus())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".cache/tokenizers/qwen3")
    p.add_argument("--model-family", default="qwen3")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="reply lengths (default 1024 4096 16384 32768; paced: 16384 32768)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help="engine streaming modes (default both; paced: deltas)")
    p.add_argument("--paced", action="store_true",
                   help="the sim decodes at --pace-ms a token (a real engine's pace: an event is a read of its own)")
    p.add_argument("--pace-ms", type=float, default=0.5, help="the sim's decode time per token with --paced")
    p.add_argument("--reps", type=int, default=2, help="chats of each kind per length (the median is reported)")
    p.add_argument("--chat-timeout", type=float, default=300.0, help="a chat slower than this is reported, not waited")
    p.add_argument("--no-floor", action="store_true", help="skip the floor proxy's run")
    p.add_argument("--engine-stream-interval", type=int, default=0,
                   help="tokens per engine event the server (and the floor) ask for: 0 the server's default "
                   "(engine/pacing.py), 1 one event per token, -1 nothing asked (for a --server-src from before "
                   "engine/pacing.py)")
    p.add_argument("--engine-arg", action="append", default=[], help="extra sglang-sim argument (repeatable)")
    p.add_argument("--server-src", default=None, help="run session-server from this source tree (a patched copy)")
    add_stack_args(p)
    args = parse_stack_args(p, argv)
    if args.tokens is None:
        args.tokens = [16384, 32768] if args.paced else [1024, 4096, 16384, 32768]
    if args.modes is None:
        args.modes = ["deltas"] if args.paced else list(MODES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server_cpu, engine_cpu, pin_note = pinning_plan(args.server_cpu, args.engine_cpu)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-stream-"))
    figs = Figures()
    results: dict[str, Any] = {}
    for mode in args.modes:
        for floor in ([False] if args.no_floor else [True, False]):
            results[f"{mode}{'_floor' if floor else ''}"] = run_mode(mode, args, (server_cpu, engine_cpu), log_dir,
                                                                     floor)
    errors = 0
    print()
    engine = (f"the engine paced at {args.pace_ms:g} ms a token" if args.paced
              else "the engine configured for one event per token")
    print(f"streamed vs unstreamed server CPU per chat, {engine} ({pin_note})")
    print("| mode | reply tokens | unstreamed ms | streamed ms | streamed / unstreamed | floor unstreamed ms | "
          "floor streamed ms | streamed x floor streamed | engine MiB streamed | tokens per engine event | "
          "agent chunks | largest gap, tokens | largest gap, ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        for tokens, row in results[mode].items():
            base = results.get(f"{mode}_floor", {}).get(tokens)
            plain, streamed = row["plain"], row["streamed"]
            errors += len(plain["errors"]) + len(streamed["errors"])
            ratio = streamed["cpu_ms"] / plain["cpu_ms"] if plain["cpu_ms"] else None
            k = f"{'paced_' if args.paced else ''}{mode}_{tokens // 1024}k"
            figs.add(f"{k}_unstreamed_cpu_ms", plain["cpu_ms"], "ms", "lower", floor=1.0)
            figs.add(f"{k}_streamed_cpu_ms", streamed["cpu_ms"], "ms", "lower", floor=1.0)
            figs.add(f"{k}_streamed_over_unstreamed", ratio, "x", "lower", floor=0.1)
            x_floor = None
            if base is not None:
                figs.add(f"{k}_floor_unstreamed_cpu_ms", base["plain"]["cpu_ms"], "ms", "lower", floor=1.0)
                figs.add(f"{k}_floor_streamed_cpu_ms", base["streamed"]["cpu_ms"], "ms", "lower", floor=1.0)
                x_floor = streamed["cpu_ms"] / base["streamed"]["cpu_ms"] if base["streamed"]["cpu_ms"] else None
                figs.add(f"{k}_streamed_x_floor", x_floor, "x floor", "lower", floor=0.1)
            note = f" ({'; '.join(streamed['errors'])})" if streamed["errors"] else ""
            asked = (stream_interval(args.engine_stream_interval, mode == "deltas", tokens + 16, None)
                     if args.engine_stream_interval >= 0 else 1)
            print(f"| {mode} | {tokens} | {fmt(plain['cpu_ms'])} | {fmt(streamed['cpu_ms'])}{note} | {fmt(ratio)} | "
                  f"{fmt(base and base['plain']['cpu_ms'])} | {fmt(base and base['streamed']['cpu_ms'])} | "
                  f"{fmt(x_floor)} | {streamed['engine_mib']:.1f} | "
                  f"{asked} | "
                  f"{streamed['chunks']} | {streamed['max_gap_tokens']} | {fmt(streamed['max_gap_ms'])} |")
            if streamed["max_gap_tokens"] is not None:
                figs.add(f"{k}_max_gap_tokens", streamed["max_gap_tokens"], "tokens", "lower", floor=1.0)
                figs.add(f"{k}_max_gap_ms", streamed["max_gap_ms"], "ms", "lower", floor=1.0)
    print("target: streamed / unstreamed <= 2 at 16k and 32k tokens, in both modes (docs/design.md 7)")
    if args.json_out:
        write_report(args.json_out, "stream", {**vars(args), "pinning": pin_note}, figs, results=results)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
