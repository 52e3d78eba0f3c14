"""A GRPO group's first turns as forks of one primed session against 8 independent sessions, beside the floor.

Part 1 (real processes, pinned apart; the emulated engine): a group of G (8) first turns of one ~4k-token prompt with
8 tool schemas, each asking for a short reply, launched together as a group is. Three ways, every round in a rotating
order, each round with a new prompt (a new task: the first-turn cache holds nothing of it):

- floor: the G requests through benchmarks/floor_proxy.py (POST /sessions, then the G chats): the least a chat proxy
  on our stack spends on them (it sends the engine text, which the engine tokenizes on its own core);
- independent: G sessions, each opened and sent the first request (today's group: one render, G-1 first-turn cache
  hits);
- forks: the group made in one request (POST /sessions with `prime` and `n`: one render, the engine's prefill of the
  prompt, G sessions forked at it), then each child sent the same first request (no render: the primed ids).

Server CPU is the process's schedstat runtime (ns, all threads) from the first request of the group to its last
reply; the figure is each way's median over the rounds as a multiple of the floor's median (the floor's group: its
G session opens and G chats). The forks' CPU is also split into its setup (the one request that makes the group) and
the G first turns after it. The engine's prefilled
tokens are the sim's books as the replies report them (prompt tokens less cached tokens, per turn, and the forks'
prime's prefill). The same ratios are also given for the server's and the engine's CPU together: the floor's text is
tokenized by the engine (8 times a group), the server's ids were tokenized once.

Part 2 (in process, the real tokenizer): the memory the G histories hold after their first turns, forked and
independent, against one history (the trajectories' own bytes, `nbytes`, plus what the forks share once: the primed
prompt's ids, logprobs and mask, the head every child's buffer holds by reference), and at the fork.

    python -m benchmarks.bench_forks --tokenizer .cache/tokenizers/qwen3 --json-out out/forks.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.benchlib import (
    Figures,
    add_stack_args,
    floor_args,
    parse_stack_args,
    proc_runtime_ns,
    start_floor,
    start_pair,
    tool_schemas,
    words,
    write_report,
)
from sglang_sim import directives
from trajectory import GenerateResult, LinearTrajectory, SegmentSet, get_family
from trajectory.forks import plan_fork

WAYS = ("floor", "independent", "forks")


def group_prompt(rng: random.Random, task: int, prompt_words: int, reply_tokens: int) -> list[dict[str, str]]:
    """A task's opening messages: a long system text (the ~4k-token prompt) and the task's user message."""
    return [{"role": "system", "content": f"Task {task}. {words(rng, prompt_words)}"},
            {"role": "user", "content": f"Solve task {task} with the tools. {directives.tokens(reply_tokens)}"}]


async def chats(client: httpx.AsyncClient, url: str, sids: list[str], body: dict[str, Any]) -> list[dict[str, Any]]:
    """The group's first turns, launched together; each reply's usage."""
    async def one(sid: str) -> dict[str, Any]:
        resp = await client.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body)
        resp.raise_for_status()
        usage: dict[str, Any] = resp.json().get("usage") or {}
        return usage

    return list(await asyncio.gather(*(one(s) for s in sids)))


async def open_sessions(client: httpx.AsyncClient, url: str, n: int) -> list[str]:
    return [(await client.post(f"{url}/sessions", json={})).json()["session_id"] for _ in range(n)]


async def run_way(way: str, client: httpx.AsyncClient, url: str, pid: int, body: dict[str, Any],
                  group: int, engine_pid: int | None = None) -> dict[str, Any]:
    """One group's first turns one `way`; the process's CPU over it (and the engine's, given its pid) and the
    sessions to delete afterwards."""
    engine0 = proc_runtime_ns(engine_pid) if engine_pid is not None else 0
    cpu0 = proc_runtime_ns(pid)
    t0 = time.perf_counter()
    primed = 0  # prompt tokens the engine prefilled before the first turns (the prime's prefill)
    if way == "forks":  # the group in one request: rendered once, prefilled once, forked at the prompt
        made = await client.post(f"{url}/sessions", json={
            "n": group, "prime": {"messages": body["messages"], "tools": body["tools"]}})
        made.raise_for_status()
        sids = made.json()["session_ids"]
        done = made.json()["prefill"] or {}
        primed = int(done.get("prompt_tokens", 0)) - int(done.get("cached_tokens", 0))
    else:
        sids = await open_sessions(client, url, group)
    cpu1 = proc_runtime_ns(pid)
    usages = await chats(client, url, sids, body)
    cpu = proc_runtime_ns(pid) - cpu0
    engine_cpu = proc_runtime_ns(engine_pid) - engine0 if engine_pid is not None else 0
    seconds = time.perf_counter() - t0
    return {"way": way, "cpu_ns": cpu, "setup_cpu_ns": cpu1 - cpu0, "engine_cpu_ns": engine_cpu, "seconds": seconds,
            "sids": sids, "usages": usages, "primed": primed}


async def prefilled(client: httpx.AsyncClient, url: str, sids: list[str]) -> int:
    """Prompt tokens the engine computed for the sessions' turns (prompt less cached, from the turn records)."""
    total = 0
    for sid in sids:
        records = (await client.get(f"{url}/sessions/{sid}")).json()["records"]
        total += sum(int(r["prompt_tokens"]) - int(r["cached_tokens"] or 0) for r in records)
    return total


async def end_to_end(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tools = tool_schemas(args.tools)
    rows: list[dict[str, Any]] = []
    prefill: dict[str, list[int]] = {"independent": [], "forks": []}
    prompt_tokens: list[int] = []
    async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=32)) as client:
        for warm in range(2):  # connections, imports, the template: outside the measurement
            body = {"messages": group_prompt(rng, -1 - warm, 64, args.reply_tokens), "tools": tools,
                    "max_tokens": args.reply_tokens}
            for way in WAYS:
                url = urls["floor" if way == "floor" else "server"]
                out = await run_way(way, client, url, pids[way], body, args.group)
                for sid in out["sids"]:
                    await client.delete(f"{url}/sessions/{sid}")
        for r in range(args.rounds):
            order = WAYS[r % 3:] + WAYS[:r % 3]
            for way in order:
                # a new task per round and way: its first render is a miss, as a new group's is
                body = {"messages": group_prompt(rng, r * 3 + WAYS.index(way), args.prompt_words, args.reply_tokens),
                        "tools": tools, "max_tokens": args.reply_tokens}
                url = urls["floor" if way == "floor" else "server"]
                out = await run_way(way, client, url, pids[way], body, args.group, pids["engine"])
                if way != "floor":
                    prefill[way].append(out["primed"] + await prefilled(client, url, out["sids"]))
                    prompt_tokens.append(int(out["usages"][0]["prompt_tokens"]))
                for sid in out["sids"]:
                    await client.delete(f"{url}/sessions/{sid}")
                rows.append({k: v for k, v in out.items() if k not in ("sids", "usages", "primed")})
    return {"rows": rows, "prefill": prefill, "prompt_tokens": prompt_tokens}


def summarize(e2e: dict[str, Any], figs: Figures, args: argparse.Namespace) -> None:
    medians = {way: statistics.median(r["cpu_ns"] for r in e2e["rows"] if r["way"] == way) / 1e6 for way in WAYS}
    figs.add("prompt_tokens", statistics.median(e2e["prompt_tokens"]), "tokens")
    figs.add("rounds", args.rounds, "count")
    for way in WAYS:
        figs.add(f"{way}_group_cpu_ms", medians[way], "ms", "lower", floor=0.5)
        chats_ms = statistics.median(r["cpu_ns"] - r["setup_cpu_ns"] for r in e2e["rows"] if r["way"] == way) / 1e6
        figs.add(f"{way}_first_turns_cpu_ms", chats_ms, "ms", "lower", floor=0.5)
    # forks' setup: the one request that renders, prefills and forks the group, before the first turns
    figs.add("forks_setup_cpu_ms", statistics.median(r["setup_cpu_ns"] for r in e2e["rows"] if r["way"] == "forks")
             / 1e6, "ms", "lower", floor=0.5)
    figs.add("independent_vs_floor", medians["independent"] / medians["floor"], "x", "lower", floor=0.05)
    figs.add("forks_vs_floor", medians["forks"] / medians["floor"], "x", "lower", floor=0.05)
    figs.add("forks_vs_independent", medians["forks"] / medians["independent"], "x", "lower", floor=0.05)
    turns = {way: figs.values[f"{way}_first_turns_cpu_ms"] for way in WAYS}
    # the G chats alone, against the floor's G chats alone (its opens are not the turns' cost either)
    figs.add("forks_first_turns_vs_floor_first_turns", turns["forks"] / turns["floor"], "x", "lower",  # type: ignore[operator]
             floor=0.05)
    figs.add("independent_first_turns_vs_floor_first_turns", turns["independent"] / turns["floor"], "x",  # type: ignore[operator]
             "lower", floor=0.05)
    for way in ("independent", "forks"):
        figs.add(f"{way}_prefilled_tokens", statistics.median(e2e["prefill"][way]), "tokens", "lower")
    # Server and engine together: the floor sends text, which the engine tokenizes (as SGLang's tokenizer manager
    # does, on its own core); the session server sends ids, having tokenized once. The engine's side of the group
    # also holds its emulated prefill and decode bookkeeping, the same for every way but for the tokenizing.
    totals = {way: statistics.median(r["cpu_ns"] + r["engine_cpu_ns"] for r in e2e["rows"] if r["way"] == way) / 1e6
              for way in WAYS}
    for way in WAYS:
        figs.add(f"{way}_group_with_engine_cpu_ms", totals[way], "ms", "lower", floor=0.5)
    figs.add("forks_with_engine_vs_floor_with_engine", totals["forks"] / totals["floor"], "x", "lower", floor=0.05)
    figs.add("independent_with_engine_vs_floor_with_engine", totals["independent"] / totals["floor"], "x", "lower",
             floor=0.05)


# -- part 2: memory ----------------------------------------------------------------------------------------------------

def first_reply(family: Any, prompt_ids: np.ndarray, n: int, rid: str) -> tuple[GenerateResult, dict[str, Any]]:
    text = family.format_completion(f"answer {rid} " + "x " * n, None, [])
    ids = [*family.encode(text), family.stop_token_after(text)]
    result = GenerateResult(text=text, output_ids=np.asarray(ids, np.int32), logprobs=np.full(len(ids), -0.25,
                            np.float32), finish_reason={"type": "stop", "matched": ids[-1]},
                            prompt_tokens=len(prompt_ids), completion_tokens=len(ids), rid=rid)
    return result, family.parse_completion(text).to_message(f"call_{rid}")


def memory(tokenizer_dir: str, args: argparse.Namespace, figs: Figures) -> None:
    from transformers import AutoTokenizer

    family = get_family(args.model_family, AutoTokenizer.from_pretrained(tokenizer_dir))
    messages = group_prompt(random.Random(args.seed), 0, args.prompt_words, args.reply_tokens)
    tools = tool_schemas(args.tools)

    def turn(traj: LinearTrajectory, k: int) -> None:
        plan = traj.prepare(messages, tools)
        traj.commit(plan, *first_reply(family, plan.prompt_ids, args.reply_tokens, f"r{k}"))

    one = LinearTrajectory(family)
    turn(one, 0)
    independent = [LinearTrajectory(family) for _ in range(args.group)]
    for k, traj in enumerate(independent):
        turn(traj, k)
    parent = LinearTrajectory(family)
    parent.set_primed(parent.prime(messages, tools))
    segments = SegmentSet(lambda: LinearTrajectory(family))
    segments.get(0).trajectory = parent
    children = [c.main for c in plan_fork(segments, lambda: SegmentSet(lambda: LinearTrajectory(family)), args.group,
                                          0).children]
    assert parent.primed is not None
    primed_bytes = parent.primed.nbytes  # held once, by every child (its ids, zero logprobs and mask)
    at_fork = sum(c.nbytes for c in children) + primed_bytes
    for k, traj in enumerate(children):
        turn(traj, k)
    after = sum(c.nbytes for c in children) + primed_bytes
    figs.add("one_history_bytes", one.nbytes, "B")
    figs.add("independent_histories_vs_one", sum(t.nbytes for t in independent) / one.nbytes, "x", "lower")
    figs.add("forked_histories_at_fork_vs_one", at_fork / one.nbytes, "x", "lower")
    figs.add("forked_histories_after_first_turns_vs_one", after / one.nbytes, "x", "lower")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".cache/tokenizers/qwen3")
    p.add_argument("--model-family", default="qwen3")
    p.add_argument("--group", type=int, default=8, help="G: the group's size")
    p.add_argument("--tools", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=3000, help="words of the system text (~1.3 tokens each)")
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--skip-server", action="store_true", help="only the in-process memory part")
    add_stack_args(p)
    return parse_stack_args(p, argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    figs = Figures()
    if not args.skip_server:
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_forks_"))
        server_args = ["--max-fork", str(max(64, args.group)), *args.server_arg]
        sim, server = start_pair(tokenizer=args.tokenizer, family=args.model_family, engine_cpu=args.engine_cpu,
                                 server_cpu=args.server_cpu, log_dir=log_dir, engine_args=[],
                                 server_args=server_args)
        floor = None
        try:
            floor = start_floor(sim.url, *floor_args(server_args), cpu=args.server_cpu, log_dir=log_dir)
            urls = {"server": server.url, "floor": floor.url}
            pids = {"floor": floor.pid, "independent": server.pid, "forks": server.pid, "engine": sim.pid}
            summarize(asyncio.run(end_to_end(urls, pids, args)), figs, args)
        finally:
            for proc in (floor, server, sim):
                if proc is not None:
                    proc.stop()
    memory(args.tokenizer, args, figs)
    for name, value in figs.values.items():
        print(f"{name:48s} {value!s:>14} {figs.meta[name]['unit']}")
    if args.json_out:
        write_report(args.json_out, "bench_forks", {k: v for k, v in vars(args).items() if k != "json_out"}, figs)


if __name__ == "__main__":
    main()
