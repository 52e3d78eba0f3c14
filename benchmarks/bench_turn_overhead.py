"""Per-turn overhead of the session server: what a turn costs on top of the engine call it makes.

Part 1 (end to end, real processes, pinned apart): S sessions x T turns whose histories grow to ~4k tokens (each
user message asks the emulated engine for a reply of R tokens with `[[sim: tokens R]]`). Turns run one at a time,
with turn indices interleaved across sessions (each round mixes short and long histories, so machine drift does not
masquerade as a history effect), and each figure is a clean per-turn cost at a known history length. After every
chat the benchmark reads the exact prompt ids the server sent (GET /sessions/{id}: token ids + usage) and replays
the same `/generate` call straight to the engine: added latency = server turn - direct engine call. The server's CPU per
turn is its schedstat runtime (ns, all threads) across the chat; its memory per stored token is the RSS delta over
the run divided by the stored tokens.

The floor (benchmarks/floor_proxy.py) runs in the same part 1, on the server's core, and every turn goes through it and
the server alternately (the order rotating from turn to turn), so a drift of the machine lands on both alike and the
ratio compares the same moments. `--baseline-src DIR` (repeatable) adds session servers run from other source trees
(e.g. `git archive COMMIT | tar -x -C DIR`) to the same rotation: a before/after table from one run.

Part 2 (in process, the real tokenizer): TITO `prepare()` of one appended user message on histories of
1k/4k/8k/32k tokens against a full re-render + re-tokenize of the same conversation (what TITO avoids), and the
trajectory's own bytes per stored token (`nbytes`, and everything it retains, traced with tracemalloc).

    python -m benchmarks.bench_turn_overhead --tokenizer .cache/tokenizers/qwen3 --json-out out/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import signal
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.benchlib import (
    Figures,
    add_stack_args,
    affinity,
    all_cpus,
    floor_args,
    fmt,
    median_seconds,
    parse_stack_args,
    pct,
    pinning_plan,
    proc_kib,
    proc_runtime_ns,
    proc_schedstat,
    run_async,
    start_floor,
    start_pair,
    start_profiler,
    summarize_collapsed,
    tool_schemas,
    user_message,
    words,
    write_report,
)
from harness.launchers import start_session_server, start_sim

# ---------------------------------------------------------------------------------------------------------------
# Part 1: through the server vs straight to the engine
# ---------------------------------------------------------------------------------------------------------------


def stored_ids(state: dict[str, Any]) -> list[int]:
    ids = state.get("token_ids")
    if ids is None:
        ids = (state.get("trajectory") or {}).get("token_ids")
    if ids is None:
        raise KeyError(f"GET /sessions/{{id}} has no token_ids (keys: {sorted(state)})")
    return [int(t) for t in ids]


@dataclass(frozen=True)
class Target:
    """One process the turns go through: the session server under test, the floor, or a baseline server."""

    name: str
    url: str
    pid: int


async def end_to_end(
    targets: list[Target], engine_url: str, args: argparse.Namespace,
    before_turns: Any = None, after_turns: Any = None,
) -> dict[str, Any]:
    """Phase 1: every turn through each target in turn (timed, CPU measured; the first target profiled). Phase 2, for
    the first target only: one GET per session for the stored ids; turn t's prompt is their first
    usage.prompt_tokens ids (history is append-only, and the family's trimmed stop-token tail lies past every earlier
    prompt). Phase 3: the same prompts straight to the engine. Returns the first target's figures, and the other
    targets' phase-1 rows under "others"."""
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    timeout = httpx.Timeout(120.0)
    errors: list[str] = []
    rows: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    async with contextlib.AsyncExitStack() as stack:
        clients = {t.name: await stack.enter_async_context(httpx.AsyncClient(base_url=t.url, limits=limits,
                                                                             timeout=timeout)) for t in targets}
        engine = await stack.enter_async_context(httpx.AsyncClient(base_url=engine_url, limits=limits,
                                                                   timeout=timeout))
        main, server = targets[0], clients[targets[0].name]
        # Warm every path (connections, first-call imports, the template) outside the measurement.
        for t in targets:
            warm = (await clients[t.name].post("/sessions", json={})).json()["session_id"]
            for _ in range(3):
                body = {"messages": [user_message(rng, -1, 0, 8, 8)], "max_tokens": 64}
                (await clients[t.name].post(f"/sessions/{warm}/v1/chat/completions", json=body)).raise_for_status()
            await clients[t.name].delete(f"/sessions/{warm}")

        if before_turns is not None:
            before_turns()
        stages_before = await stage_totals(server)
        rss_before = proc_kib(main.pid, "VmRSS")
        sids = {t.name: [(await clients[t.name].post("/sessions", json={})).json()["session_id"]
                         for _ in range(args.sessions)] for t in targets}
        histories: dict[str, list[list[dict[str, Any]]]] = {t.name: [[] for _ in range(args.sessions)]
                                                            for t in targets}
        tools = tool_schemas(args.tools)
        wait0 = proc_schedstat(main.pid)[1]
        t_start = time.perf_counter()
        # Interleaved turn indices: session s starts `s mod T` rounds late, so every round mixes short and long
        # histories and a slow drift of the machine (other tenants, thermal, the allocator) lands on every turn
        # index alike instead of on the last ones; the per-history column then compares like with like.
        offsets = [s % args.turns for s in range(args.sessions)]
        stages_last_round = stages_before
        group_first: dict[int, dict[str, str]] = {}  # a group's shared first message (--group-size)
        for rnd in range(2 * args.turns - 1):
            due = [(s, rnd - offsets[s]) for s in range(args.sessions) if 0 <= rnd - offsets[s] < args.turns]
            if rnd == 2 * args.turns - 2:  # the last round holds only last turns: their stages on their own
                stages_last_round = await stage_totals(server)
            rng.shuffle(due)
            messages = {}
            for s, turn in due:
                if turn == 0 and (s // args.group_size) in group_first:
                    messages[s] = group_first[s // args.group_size]
                else:
                    messages[s] = user_message(rng, s, turn, args.user_words, args.reply_tokens)
                    if turn == 0:
                        group_first[s // args.group_size] = messages[s]
            # A round's turns go through one target after another (whose turn is first rotates), not each turn
            # through every target: targets share a core, and switching at every turn would leave each one's caches
            # cold and add the switching to every figure.
            for t in targets[rnd % len(targets):] + targets[:rnd % len(targets)]:
                for s, turn in due:
                    history = histories[t.name][s]
                    history.append(messages[s])
                    body = {"messages": history, "max_tokens": 2 * args.reply_tokens, "temperature": 1.0}
                    if args.tools:
                        body["tools"] = tools
                    cpu0 = proc_runtime_ns(t.pid)
                    t0 = time.perf_counter()
                    r = await clients[t.name].post(f"/sessions/{sids[t.name][s]}/v1/chat/completions", json=body)
                    t1 = time.perf_counter()
                    cpu1 = proc_runtime_ns(t.pid)
                    if r.status_code != 200:
                        errors.append(f"{t.name} session {s} turn {turn}: HTTP {r.status_code} {r.text[:300]}")
                        history.pop()
                        continue
                    reply = r.json()
                    usage = reply["usage"]
                    history.append({k: v for k, v in reply["choices"][0]["message"].items() if v is not None})
                    rows[t.name].append({
                        "session": s, "turn": turn, "prompt_tokens": usage["prompt_tokens"],
                        "completion_tokens": usage["completion_tokens"], "server_s": t1 - t0,
                        "server_cpu_ns": cpu1 - cpu0,
                    })
            print(f"[overhead] round {rnd + 1}/{2 * args.turns - 1}: {len(rows[main.name])} turns, errors "
                  f"{len(errors)}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - t_start
        if after_turns is not None:
            after_turns()
        stages_after = await stage_totals(server)
        wait_frac = (proc_schedstat(main.pid)[1] - wait0) / 1e9 / wall
        await asyncio.sleep(0.5)  # let the allocator settle before reading RSS
        rss_after = proc_kib(main.pid, "VmRSS")

        ids_by_session: list[list[int]] = []
        get_cpu_ns: list[int] = []
        for sid in sids[main.name]:
            cpu0 = proc_runtime_ns(main.pid)
            state = (await server.get(f"/sessions/{sid}")).json()
            get_cpu_ns.append(proc_runtime_ns(main.pid) - cpu0)
            ids_by_session.append(stored_ids(state))
        stored = sum(len(ids) for ids in ids_by_session)

        for row in rows[main.name]:
            ids = ids_by_session[row["session"]]
            gen = {
                "input_ids": ids[: row["prompt_tokens"]],
                "sampling_params": {"max_new_tokens": 2 * args.reply_tokens, "temperature": 1.0},
                "return_logprob": True,
                "logprob_start_len": -1,
                "rid": f"direct-{row['session']}-{row['turn']}",
            }
            t2 = time.perf_counter()
            d = await engine.post("/generate", json=gen,
                                  headers={"X-SMG-Routing-Key": sids[main.name][row["session"]]})
            row["direct_s"] = time.perf_counter() - t2
            if d.status_code != 200:
                errors.append(f"direct {row['session']}/{row['turn']}: HTTP {d.status_code} {d.text[:300]}")
            elif d.json()["meta_info"]["completion_tokens"] != row["completion_tokens"]:
                errors.append(f"direct {row['session']}/{row['turn']}: a different reply length than via the server")
        for t in targets:
            for sid in sids[t.name]:
                await clients[t.name].delete(f"/sessions/{sid}")
    return {"rows": [r for r in rows[main.name] if "direct_s" in r], "errors": errors,
            "rss_before_kib": rss_before, "rss_after_kib": rss_after, "stored_tokens": stored,
            "get_cpu_ns": get_cpu_ns, "server_wait_frac": wait_frac,
            "stage_ms": stage_means(stages_before, stages_after),
            "stage_ms_last_turn": stage_means(stages_last_round, stages_after),
            "others": {t.name: rows[t.name] for t in targets[1:]}}


# ---------------------------------------------------------------------------------------------------------------
# Part 2: TITO in process
# ---------------------------------------------------------------------------------------------------------------


def engine_body(family: Any, text: str, prompt_tokens: int) -> bytes:
    """A well-formed SGLang /generate response for `text` (+ the family's stop token)."""
    import json

    ids = [*family.encode(text), family.eos_token_id]
    return json.dumps({
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": "bench", "finish_reason": {"type": "stop", "matched": family.eos_token_id},
            "prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "cached_tokens": 0,
            "output_token_logprobs": [[-0.25, t, None] for t in ids], "weight_version": "0", "e2e_latency": 0.0,
        },
    }).encode()


def build_trajectory(family: Any, target_tokens: int, reply_tokens: int, user_words: int, seed: int):
    """Commit turns (user message + reply of ~reply_tokens) until the stored history reaches target_tokens."""
    import trajectory

    rng = random.Random(seed)
    traj = trajectory.LinearTrajectory(family)
    messages: list[dict[str, Any]] = []
    turn = 0
    while traj.num_tokens < target_tokens:
        messages.append(user_message(rng, 0, turn, user_words, reply_tokens))
        plan = traj.prepare(messages, None)
        reply = words(rng, int(reply_tokens * 0.75))
        result = trajectory.decode_generate_response(
            engine_body(family, reply, len(plan.prompt_ids)), family.vocab_size
        )
        message = {"role": "assistant", "content": reply}
        traj.commit(plan, result, message)
        messages.append(message)
        turn += 1
    return traj, messages


def tito_in_process(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    import trajectory

    family = trajectory.get_family(args.model_family, AutoTokenizer.from_pretrained(args.tokenizer))
    rng = random.Random(args.seed + 1)
    out: dict[str, Any] = {"sizes": []}
    for size in args.tito_sizes:
        traj, messages = build_trajectory(family, size, min(1000, size // 4), args.user_words, args.seed)
        nxt = [*messages, user_message(rng, 0, 999, args.user_words, args.reply_tokens)]
        reps = args.tito_reps if size <= 8192 else max(5, args.tito_reps // 4)
        prepare_s = median_seconds(lambda traj=traj, nxt=nxt: traj.prepare(nxt, None), reps)
        # The same turn matched through a session's segments: one segment (every single-line session) and, up to
        # 8k tokens, eight (seven other conversations of the same size, compared by message prefix only).
        segments = trajectory.SegmentSet(lambda: trajectory.LinearTrajectory(family))
        segments.get(0).trajectory = traj
        segment_s = median_seconds(lambda segments=segments, nxt=nxt: segments.prepare(nxt, None), reps)
        eight_s = None
        if size <= 8192:
            for k in range(1, 8):
                other, _ = build_trajectory(family, size, min(1000, size // 4), args.user_words, args.seed + 100 + k)
                segments.restore(trajectory.Segment(k, other))
            eight_s = median_seconds(lambda segments=segments, nxt=nxt: segments.prepare(nxt, None), reps)
        plan = traj.prepare(nxt, None)

        def full(nxt: list[dict[str, Any]] = nxt) -> None:
            family.encode(family.render(nxt, None, True))

        full_s = median_seconds(full, max(3, reps // 4))
        reply = words(rng, 300)
        body = engine_body(family, reply, len(plan.prompt_ids))
        decode_s = median_seconds(lambda body=body: trajectory.decode_generate_response(body, family.vocab_size), reps)
        result = trajectory.decode_generate_response(body, family.vocab_size)
        t0 = time.perf_counter()
        traj.commit(plan, result, {"role": "assistant", "content": reply})
        commit_s = time.perf_counter() - t0
        row = {
            "target": size, "history_tokens": int(plan.new_token_start),
            "prompt_tokens": len(plan.prompt_ids), "new_tokens": len(plan.prompt_ids) - plan.new_token_start,
            "prepare_ms": 1000 * prepare_s, "full_retokenize_ms": 1000 * full_s, "commit_ms": 1000 * commit_s,
            "segments_1_prepare_ms": 1000 * segment_s,
            "segments_8_prepare_ms": None if eight_s is None else 1000 * eight_s,
            "decode_reply_ms": 1000 * decode_s, "nbytes_per_token": traj.nbytes / traj.num_tokens,
        }
        out["sizes"].append(row)
        print(f"[tito] history {size}: prepare {row['prepare_ms']:.3f} ms (new {row['new_tokens']} tokens), "
              f"full re-tokenize {row['full_retokenize_ms']:.2f} ms, commit {row['commit_ms']:.3f} ms; through "
              f"segments: 1 {row['segments_1_prepare_ms']:.3f} ms"
              + ("" if eight_s is None else f", 8 {row['segments_8_prepare_ms']:.3f} ms"),
              file=sys.stderr, flush=True)

    # Everything a 32k-token trajectory keeps alive (arrays, messages, records), built under tracemalloc.
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    traj, messages = build_trajectory(family, max(args.tito_sizes), args.reply_tokens, args.user_words, args.seed)
    del messages
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    out["retained_bytes_per_token"] = retained / traj.num_tokens
    out["arrays_bytes_per_token"] = traj.nbytes / traj.num_tokens
    out["retained_tokens"] = traj.num_tokens
    return out


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".cache/tokenizers/qwen3")
    p.add_argument("--model-family", default="qwen3")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--reply-tokens", type=int, default=448, help="reply length per turn ([[sim: tokens N]])")
    p.add_argument("--tools", type=int, default=0, help="tool schemas sent with every turn, as agents send them")
    p.add_argument("--group-size", type=int, default=1,
                   help="sessions in groups of G begin with the same first message, as a GRPO group's G samples of "
                   "one prompt do (default 1: every first message its own)")
    p.add_argument("--user-words", type=int, default=48, help="words per user message (~1.3 tokens each)")
    p.add_argument("--tito-sizes", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    p.add_argument("--tito-reps", type=int, default=40)
    p.add_argument("--routed-experts-bytes", type=int, default=0, help="0: measure token storage, not payloads")
    p.add_argument("--token-latency-ms", type=float, default=0.0)
    p.add_argument("--server-src", default=None, help="run session-server from this source tree (a patched copy)")
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument(
        "--journal", choices=("off", "normal", "full", "both"), default="off",
        help="also run part 1 with --journal (sync normal, full, or both), side by side with the plain run in this "
        "one invocation, and report the journal's per-turn cost (default off)",
    )
    p.add_argument("--no-floor", action="store_true",
                   help="skip the floor (floor_proxy.py beside the server, the same turns to the same engine, "
                   "alternately with the server), which part 1 otherwise reports beside the server's CPU per turn")
    p.add_argument("--baseline-src", action="append", default=[], metavar="DIR",
                   help="also run a session server from this source tree in part 1, taking every turn alternately "
                   "with the server and the floor (repeatable): a before/after comparison from one run")
    p.add_argument("--skip-server", action="store_true", help="only the in-process TITO part")
    p.add_argument("--skip-tito", action="store_true", help="only the end-to-end part")
    p.add_argument("--profile", default=None, help="py-spy the server during part 1 (.svg, or .txt for stacks)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--label", default=None)
    add_stack_args(p)
    return parse_stack_args(p, argv)


async def stage_totals(server: httpx.AsyncClient) -> dict[str, tuple[float, float]]:
    """The server's stage histograms (`session_server_stage_seconds`, metrics.py) now: (seconds, count) per stage."""
    response = await server.get("/metrics")
    response.raise_for_status()
    return parse_stage_totals(response.text)


def parse_stage_totals(text: str) -> dict[str, tuple[float, float]]:
    """(seconds, count) per stage from a Prometheus exposition text."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "session_server_stage_seconds":
            continue
        for sample in family.samples:
            slot = {"session_server_stage_seconds_sum": 0, "session_server_stage_seconds_count": 1}.get(sample.name)
            if slot is not None:
                totals.setdefault(sample.labels["stage"], [0.0, 0.0])[slot] = sample.value
    return {name: (total, count) for name, (total, count) in totals.items()}


def stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean ms per observation of each stage between two `stage_totals` readings."""
    means = {}
    for name, (total, count) in after.items():
        total0, count0 = before.get(name, (0.0, 0.0))
        if count > count0:
            means[name] = 1000 * (total - total0) / (count - count0)
    return means


def summarize_e2e(e2e: dict[str, Any], figs: Figures, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = e2e["rows"]
    added = np.array([r["server_s"] - r["direct_s"] for r in rows]) * 1000
    cpu_ms = np.array([r["server_cpu_ns"] for r in rows]) / 1e6
    figs.add("turns", len(rows), "count")
    figs.add("errors", len(e2e["errors"]), "count", "lower")
    figs.add("server_turn_p50_ms", pct([r["server_s"] * 1000 for r in rows], 50), "ms", "lower", floor=0.3)
    figs.add("direct_engine_p50_ms", pct([r["direct_s"] * 1000 for r in rows], 50), "ms", "lower", floor=0.3)
    figs.add("added_latency_p50_ms", pct(added, 50), "ms", "lower", floor=0.3)
    figs.add("added_latency_p99_ms", pct(added, 99), "ms", "lower", floor=0.5)
    figs.add("server_cpu_per_turn_mean_ms", float(cpu_ms.mean()) if cpu_ms.size else None, "ms", "lower", floor=0.1)
    figs.add("server_cpu_per_turn_p50_ms", pct(cpu_ms, 50), "ms", "lower", floor=0.1)
    figs.add("server_cpu_turns_per_s", 1000 / float(cpu_ms.mean()) if cpu_ms.size else None, "turns/s", "higher")
    by_turn = []
    for t in range(args.turns):
        sel = [r for r in rows if r["turn"] == t]
        if not sel:
            continue
        by_turn.append({
            "turn": t + 1,
            "prompt_tokens_mean": float(np.mean([r["prompt_tokens"] for r in sel])),
            "server_cpu_ms_p50": pct([r["server_cpu_ns"] / 1e6 for r in sel], 50),
            "added_latency_ms_p50": pct([(r["server_s"] - r["direct_s"]) * 1000 for r in sel], 50),
            "added_latency_ms_p99": pct([(r["server_s"] - r["direct_s"]) * 1000 for r in sel], 99),
        })
    if by_turn:
        last = by_turn[-1]
        figs.add("history_tokens_last_turn", last["prompt_tokens_mean"], "tokens")
        figs.add("server_cpu_per_turn_last_turn_ms", last["server_cpu_ms_p50"], "ms", "lower", floor=0.1)
        figs.add("added_latency_last_turn_p50_ms", last["added_latency_ms_p50"], "ms", "lower", floor=0.3)
    for name, ms in e2e["stage_ms"].items():
        figs.add(f"server_stage_{name}_ms", ms, "ms", "lower", floor=0.02)
    for name, ms in e2e["stage_ms_last_turn"].items():
        figs.add(f"server_stage_{name}_last_turn_ms", ms, "ms", "lower", floor=0.02)
    figs.add("get_session_cpu_ms", pct(np.array(e2e["get_cpu_ns"]) / 1e6, 50), "ms", "lower", floor=0.2)
    figs.add("server_runqueue_wait_frac", e2e["server_wait_frac"], "fraction", "lower", floor=0.02)
    stored = e2e["stored_tokens"]
    delta = (e2e["rss_after_kib"] - e2e["rss_before_kib"]) * 1024
    figs.add("stored_tokens", stored, "tokens")
    figs.add("server_rss_delta_bytes_per_token", delta / stored if stored else None, "B/token", "lower", floor=4.0)
    return by_turn


def cpu_per_turn(rows: list[dict[str, Any]], last_turn: int) -> tuple[float | None, float | None]:
    """Mean server CPU per turn, and the median at the last turn, in ms."""
    cpu_ms = np.array([r["server_cpu_ns"] for r in rows]) / 1e6
    last = [r["server_cpu_ns"] / 1e6 for r in rows if r["turn"] == last_turn]
    return (float(cpu_ms.mean()) if cpu_ms.size else None), pct(last, 50)


def part1(
    args: argparse.Namespace, server_cpu: int | None, engine_cpu: int | None, log_dir: Path, server_args: list[str],
    profile: bool, pin_note: str, floor: bool = False, baselines: Sequence[str] = (),
) -> tuple[Figures, dict[str, Any]]:
    """One end-to-end run (part 1) against a fresh sim and a session server started with `server_args`; with
    `floor`, the floor proxy, and with `baselines`, a session server from each of those source trees, take every
    turn alternately with it, on the same core."""
    figs = Figures()
    extra: dict[str, Any] = {}
    engine_args = ["--routed-experts-bytes", str(args.routed_experts_bytes),
                   "--token-latency-ms", str(args.token_latency_ms), *args.engine_arg]
    kv = max(1 << 20, 4 * args.sessions * args.turns * (args.reply_tokens + 2 * args.user_words + 64))
    if not any(a.startswith("--kv-capacity-tokens") for a in args.engine_arg):
        engine_args += ["--kv-capacity-tokens", str(kv)]
    sim, server = start_pair(
        tokenizer=args.tokenizer, family=args.model_family, engine_cpu=engine_cpu, server_cpu=server_cpu,
        log_dir=log_dir, engine_args=engine_args, server_args=server_args, server_src=args.server_src,
    )
    # Each other target gets an engine of its own (on the engine's core), so the server's engine holds exactly what
    # a run without them would: its direct replays (added latency) are unchanged by the company.
    others: list[Target] = []
    started: list[Any] = []  # every process started here: stopped in the finally below, even if a later start fails
    try:
        cpus = None if engine_cpu is None else {engine_cpu}
        for name in ["floor"] * floor + [f"baseline:{src}" for src in baselines]:
            own = start_sim(args.tokenizer, args.model_family, *engine_args, cpus=cpus, log_dir=log_dir,
                            startup_timeout=120.0)
            started.append(own)
            if name == "floor":
                proc = start_floor(own.url, *floor_args(server_args), cpu=server_cpu, log_dir=log_dir)
            else:
                proc = start_session_server(
                    own.url, args.tokenizer, args.model_family, *server_args,
                    cpus=None if server_cpu is None else {server_cpu}, log_dir=log_dir, startup_timeout=120.0,
                    python_path=[name.removeprefix("baseline:")], name=f"session-server-{len(others) + 2}")
            started.append(proc)
            others.append(Target(name, proc.url, proc.pid))
        if engine_cpu is not None:
            os.sched_setaffinity(0, {engine_cpu})  # the sequential driver shares the engine's core
        extra["pinning"] = {"note": pin_note, "session-server": affinity(server.pid),
                            "sglang-sim": affinity(sim.pid), "benchmark": affinity(os.getpid())}
        profiler: list[Any] = []

        def begin_profile() -> None:  # after the warm-up (the first chat compiles the chat template)
            if profile and args.profile:
                profiler.append(start_profiler(server.pid, args.profile, 3600, rate=1000))
                time.sleep(1.0)  # py-spy attaches

        def end_profile() -> None:  # only the turns are profiled, not the GETs and the replay
            for p in profiler:
                if p is not None:
                    p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                    p.communicate(timeout=60)

        targets = [Target("server", server.url, server.pid), *others]
        e2e = run_async(end_to_end(targets, sim.url, args, begin_profile, end_profile))
    finally:
        for proc in reversed(started):  # each process before the engine it fronts
            proc.stop()
        server.stop()
        sim.stop()
        os.sched_setaffinity(0, all_cpus())  # part 2 runs unpinned
    extra["by_turn"] = summarize_e2e(e2e, figs, args)
    extra["error_samples"] = e2e["errors"][:8]
    extra["others"] = {name: cpu_per_turn(rows, args.turns - 1) for name, rows in e2e["others"].items()}
    return figs, extra


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figs = Figures()
    extra: dict[str, Any] = {}
    pin_note = "not run"
    errors = 0
    if not args.skip_server:
        server_cpu, engine_cpu, pin_note = pinning_plan(args.server_cpu, args.engine_cpu)
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-overhead-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        syncs = {"off": [], "normal": ["normal"], "full": ["full"], "both": ["normal", "full"]}[args.journal]
        # The journal variants first, then the plain run (whose figures are the report's main ones): same machine,
        # same sim settings, one after the other.
        for sync in syncs:
            journal = log_dir / f"journal-{sync}.sqlite"
            jfigs, _ = part1(args, server_cpu, engine_cpu, log_dir,
                             [*args.server_arg, "--journal", str(journal), "--journal-sync", sync], False, pin_note)
            jv = jfigs.values
            for key in ("server_cpu_per_turn_mean_ms", "server_cpu_per_turn_p50_ms", "added_latency_p50_ms",
                        "added_latency_p99_ms", "errors"):
                figs.add(f"journal_{sync}_{key}", jv.get(key), "ms" if key != "errors" else "count", "lower")
            figs.add(f"journal_{sync}_file_bytes", sum(
                p.stat().st_size for p in (journal, Path(f"{journal}-wal")) if p.exists()), "bytes")
            errors += int(jv.get("errors") or 0)
        pfigs, pextra = part1(args, server_cpu, engine_cpu, log_dir, args.server_arg, True, pin_note,
                              floor=not args.no_floor, baselines=args.baseline_src)
        figs.values.update(pfigs.values)
        figs.meta.update(pfigs.meta)
        others = pextra.pop("others")
        if "floor" in others:
            for key, value in zip(("server_cpu_per_turn_mean_ms", "server_cpu_per_turn_last_turn_ms"),
                                  others["floor"], strict=True):
                figs.add(f"floor_{key}", value, "ms", "lower")
                ours = figs.values.get(key)
                figs.add(f"{key.removesuffix('_ms')}_x_floor", ours / value if ours and value else None,
                         "x floor", "lower", floor=0.05)
            # The gap to the floor, split: the stages the floor has no counterpart of (TITO prepare, the strict
            # decode of the reply's ids and logprobs, the commit), and the rest of the server's CPU at the last turn.
            stages = [figs.values.get(f"server_stage_{name}_last_turn_ms") for name in ("prepare", "decode", "commit")]
            last = figs.values.get("server_cpu_per_turn_last_turn_ms")
            floor_last = figs.values.get("floor_server_cpu_per_turn_last_turn_ms")
            if last and floor_last and all(ms is not None for ms in stages):
                own = sum(ms for ms in stages if ms is not None)
                figs.add("server_stages_last_turn_x_floor", own / floor_last, "x floor", "lower", floor=0.05)
                figs.add("server_rest_last_turn_x_floor", (last - own) / floor_last, "x floor", "lower", floor=0.05)
        extra["baselines"] = {name.removeprefix("baseline:"): {"cpu_per_turn_mean_ms": mean,
                                                               "cpu_per_turn_last_turn_ms": last}
                              for name, (mean, last) in others.items() if name.startswith("baseline:")}
        extra.update(pextra)
        errors += int(pfigs.values.get("errors") or 0)
    if not args.skip_tito:
        tito = tito_in_process(args)
        for row in tito["sizes"]:
            k = f"{row['target'] // 1024}k"
            figs.add(f"tito_prepare_{k}_ms", row["prepare_ms"], "ms", "lower", floor=0.05)
            figs.add(f"full_retokenize_{k}_ms", row["full_retokenize_ms"], "ms", "lower", floor=0.2)
            figs.add(f"commit_{k}_ms", row["commit_ms"], "ms", "lower", floor=0.05)
        figs.add("decode_reply_ms", tito["sizes"][-1]["decode_reply_ms"], "ms", "lower", floor=0.02)
        figs.add("trajectory_array_bytes_per_token", tito["arrays_bytes_per_token"], "B/token", "lower", floor=0.5)
        figs.add("trajectory_retained_bytes_per_token", tito["retained_bytes_per_token"], "B/token", "lower",
                 floor=1.0)
        extra["tito"] = tito

    v = figs.values
    print()
    print(f"session-server per-turn overhead ({pin_note}: {extra.get('pinning', {})})")
    if "turns" in v:
        print(f"  {v['turns']} turns ({args.sessions} sessions x {args.turns}), errors {v['errors']}; history at the "
              f"last turn ~{fmt(v.get('history_tokens_last_turn'))} tokens")
        print(f"  turn latency    server p50 {fmt(v['server_turn_p50_ms'])} ms, engine direct p50 "
              f"{fmt(v['direct_engine_p50_ms'])} ms")
        print(f"  added latency   p50 {fmt(v['added_latency_p50_ms'])} ms, p99 "
              f"{fmt(v['added_latency_p99_ms'])} ms")
        print(f"  server CPU/turn mean {fmt(v['server_cpu_per_turn_mean_ms'])} ms "
              f"({fmt(v['server_cpu_turns_per_s'])} turns per CPU-second), at the last turn "
              f"{fmt(v.get('server_cpu_per_turn_last_turn_ms'))} ms (target <= 0.5 ms at 4k)")
        if "floor_server_cpu_per_turn_mean_ms" in v:
            print(f"  FLOOR           {fmt(v['floor_server_cpu_per_turn_mean_ms'])} ms of CPU per turn through the "
                  f"floor proxy, {fmt(v['floor_server_cpu_per_turn_last_turn_ms'])} ms at the last turn: the server "
                  f"costs {fmt(v['server_cpu_per_turn_mean_x_floor'])}x the floor, "
                  f"{fmt(v['server_cpu_per_turn_last_turn_x_floor'])}x at the last turn (target <= 1.5x; the "
                  "floor took every turn alternately with the server)")
        for when, suffix in (("over all measured turns", ""), ("at the last turn", "_last_turn")):
            if f"server_stage_decode{suffix}_ms" in v:
                print(f"  STAGES          wall time per turn in the server {when}: " + ", ".join(
                    f"{name} {fmt(v[f'server_stage_{name}{suffix}_ms'])} ms" for name in ("prepare", "decode", "commit")
                    if f"server_stage_{name}{suffix}_ms" in v))
        if v.get("server_stages_last_turn_x_floor") is not None:
            print(f"  GAP             at the last turn, the server's prepare (TITO), decode (the strict check of the "
                  f"reply's token ids and logprobs) and commit take {fmt(v['server_stages_last_turn_x_floor'])}x the "
                  f"floor's whole turn; the rest of its CPU (HTTP, engine client, reply) "
                  f"{fmt(v['server_rest_last_turn_x_floor'])}x")
        for src, b in extra.get("baselines", {}).items():
            fl, fl_last = v.get("floor_server_cpu_per_turn_mean_ms"), v.get("floor_server_cpu_per_turn_last_turn_ms")
            ratio = f", {b['cpu_per_turn_mean_ms'] / fl:.2f}x the floor" if fl and b["cpu_per_turn_mean_ms"] else ""
            last = (f", {b['cpu_per_turn_last_turn_ms'] / fl_last:.2f}x at the last turn"
                    if fl_last and b["cpu_per_turn_last_turn_ms"] else "")
            print(f"  BASELINE        {src}: {fmt(b['cpu_per_turn_mean_ms'])} ms of CPU per turn, "
                  f"{fmt(b['cpu_per_turn_last_turn_ms'])} ms at the last turn{ratio}{last}")
        print("  by turn         " + "; ".join(
            f"t{r['turn']} {r['prompt_tokens_mean']:.0f} tok: cpu {r['server_cpu_ms_p50']:.2f} ms, "
            f"{r['added_latency_ms_p50']:+.2f} ms" for r in extra["by_turn"]))
        print(f"  server RSS      {fmt(v['server_rss_delta_bytes_per_token'])} B per stored token "
              f"({v['stored_tokens']} tokens stored); GET /sessions/{{id}} at the end: "
              f"{fmt(v['get_session_cpu_ms'])} ms CPU p50")
        for sync in ("normal", "full"):
            if f"journal_{sync}_server_cpu_per_turn_mean_ms" in v:
                print(f"  --journal ({sync}) server CPU/turn mean "
                      f"{fmt(v[f'journal_{sync}_server_cpu_per_turn_mean_ms'])} ms vs "
                      f"{fmt(v['server_cpu_per_turn_mean_ms'])} ms without (same run); added latency p50 "
                      f"{fmt(v[f'journal_{sync}_added_latency_p50_ms'])} ms, p99 "
                      f"{fmt(v[f'journal_{sync}_added_latency_p99_ms'])} ms; file "
                      f"{(v[f'journal_{sync}_file_bytes'] or 0) / 1024:.0f} KiB")
        if v["server_runqueue_wait_frac"] > 0.05:
            print(f"  NOTE            the server waited for a CPU {100 * v['server_runqueue_wait_frac']:.0f}% of the "
                  "time (other load on the machine): latencies are not representative, CPU figures still are")
    if "tito" in extra:
        for row in extra["tito"]["sizes"]:
            print(f"  TITO {row['prompt_tokens']:6d} tok  prepare {row['prepare_ms']:.3f} ms for "
                  f"{row['new_tokens']} new tokens; full re-tokenize {row['full_retokenize_ms']:.2f} ms; "
                  f"commit {row['commit_ms']:.3f} ms")
        print(f"  memory/token    arrays {v['trajectory_array_bytes_per_token']:.1f} B, everything retained "
              f"{v['trajectory_retained_bytes_per_token']:.1f} B (targets: arrays <= 10 B, everything <= 24 B)")
    if args.profile and args.profile.endswith(".txt") and Path(args.profile).exists():
        print("  profile (server, % of samples: own / in stack):")
        for name, own, total in summarize_collapsed(args.profile):
            print(f"    {own:5.1f}% {total:5.1f}%  {name}")
    if extra.get("error_samples"):
        print("  first errors:\n    " + "\n    ".join(extra["error_samples"]))
    if args.json_out:
        write_report(args.json_out, "turn_overhead", {**vars(args)}, figs, **extra)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
