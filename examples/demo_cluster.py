"""`make demo-cluster`: the demo's agent episodes through nginx in front of several session-server replicas.

Starts `--engines` emulated engines, `--replicas` session-server replicas (each places its sessions over every engine,
`--engine-url` repeated, and keeps a journal) and nginx on the config `deploy.nginx` generates; runs the demo's
episodes against the balancer's one URL (the client never learns which replica serves a session), then prints the
demo's summary and, per replica, the sessions and chats it served and its errors, read from each replica's own
/metrics beside what the clients saw (the replica named in each session id). Exit 1 on any error.

    python -m examples.demo_cluster --tokenizers .cache/tokenizers --replicas 3 --engines 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deploy.admin import METRICS_TEXT
from deploy.admin import run as admin_run
from examples.demo import pad_id_of, print_table, run, summarize, write_outputs
from harness.launchers import ProcessCrashed, RunningProcess, start_sim
from harness.nginx_cluster import LocalCluster
from rollout.episodes import EpisodeResult

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3, help="session-server replicas behind nginx (default 3)")
    p.add_argument("--engines", type=int, default=2, help="emulated engines behind every replica (default 2)")
    p.add_argument("--episodes", type=int, default=64, help="agent episodes (default 64)")
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight at once (default 16)")
    p.add_argument("--model-family", default="qwen3", help="qwen3 or deepseek (default qwen3)")
    p.add_argument("--tokenizers", type=Path, default=ROOT / ".cache" / "tokenizers",
                   help="one tokenizer directory per family (`make tokenizers`)")
    p.add_argument("--max-tokens", type=int, default=256, help="max tokens per reply (default 256)")
    p.add_argument("--max-turns", type=int, default=10, help="turn limit per episode (default 10)")
    p.add_argument("--token-latency-ms", type=float, default=0.0, help="emulated decode latency (default 0)")
    p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    p.add_argument("--no-journal", action="store_true", help="replicas without --journal")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "cluster", help="output folder (default out/cluster)")
    args = p.parse_args(argv)
    # What examples.demo.run reads: emulated engines, scripted tasks, each its own prompt.
    args.engine_url, args.model, args.group_size = None, "default", 1
    return args


@contextlib.contextmanager
def cluster(args: argparse.Namespace, tokenizer: Path, workdir: Path) -> Iterator[LocalCluster]:
    """The engines, then the replicas and nginx (LocalCluster); everything stopped in reverse order."""
    sims: list[RunningProcess] = []
    c: LocalCluster | None = None
    try:
        sims = [start_sim(tokenizer, args.model_family, "--token-latency-ms", str(args.token_latency_ms),
                          "--enable-streaming-session", log_path=workdir / f"sim{i}.log", wait=False)
                for i in range(args.engines)]
        for sim in sims:
            sim.wait_ready()
        c = LocalCluster([s.url for s in sims], tokenizer, args.model_family, workdir, journal=not args.no_journal)
        c.start(args.replicas)
        for name, proc in c.procs.items():
            print(f"{name:<6} {proc.url}  (engines: {', '.join(s.url for s in sims)})")
        print(f"nginx  {c.url}  (config {c.config_path}; logs in {workdir})")
        yield c
    finally:
        failures = c.close() if c is not None else []
        for sim in reversed(sims):
            sim.stop()
        for failure in failures:
            print(failure, file=sys.stderr)


def per_replica(c: LocalCluster, results: list[EpisodeResult]) -> dict[str, dict[str, Any]]:
    """Each replica's own counts (its /metrics) beside the episodes the clients ran on it (the id names it)."""
    outcomes = asyncio.run(admin_run(list(c.replicas.values()), METRICS_TEXT, token=None, seconds=10))
    episodes = Counter(r.session_id.split(".", 1)[0] for r in results if r.session_id)
    turns = Counter()
    for r in results:
        if r.session_id:
            turns[r.session_id.split(".", 1)[0]] += r.turns
    table: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        v = o.value or {}
        table[o.replica.name] = {
            "episodes (client)": episodes[o.replica.name], "turns (client)": turns[o.replica.name],
            "sessions created": int(v.get("sessions_created_total", -1)), "chats": int(v.get("chats", -1)),
            "live sessions": int(v.get("sessions", -1)), "5xx": int(v.get("errors", -1)),
            "error": o.error,
        }
    return table


def print_replicas(table: dict[str, dict[str, Any]]) -> None:
    columns = ["episodes (client)", "turns (client)", "sessions created", "chats", "live sessions", "5xx"]
    print("replica  " + "  ".join(f"{c:>17}" for c in columns))
    for name, row in table.items():
        line = f"{name:<7}  " + "  ".join(f"{row[c]:>17}" for c in columns)
        print(line + (f"  FAIL {row['error']}" if row["error"] else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = args.tokenizers / args.model_family
    if not (tokenizer / "tokenizer_config.json").exists():
        print(f"error: no tokenizer in {tokenizer} (run `make tokenizers`)", file=sys.stderr)
        return 2
    if min(args.replicas, args.engines, args.episodes, args.concurrency) < 1:
        print("error: --replicas, --engines, --episodes and --concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        with cluster(args, tokenizer, args.out / "logs") as c:
            results, expected, elapsed = asyncio.run(run(args, c.url))
            replicas = per_replica(c, results)
    except (ProcessCrashed, TimeoutError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = summarize(results, expected, elapsed, scripted=True)
    print_table(summary)
    print_replicas(replicas)
    for r in [r for r in results if not r.ok][:5]:
        print(f"episode {r.index} failed: {r.error}", file=sys.stderr)
    write_outputs(args.out, results, pad_id_of(tokenizer))
    (args.out / "summary.json").write_text(json.dumps({**summary, "replicas": replicas}, indent=2) + "\n")
    errors = summary["errors"] + sum(max(0, row["5xx"]) + bool(row["error"]) for row in replicas.values())
    agree = all(row["sessions created"] == row["episodes (client)"] and row["chats"] == row["turns (client)"]
                for row in replicas.values())
    print(f"errors: {errors}; per-replica counts {'agree' if agree else 'DISAGREE'} with what the clients saw; "
          f"outputs in {args.out}")
    return 0 if errors == 0 and agree else 1


if __name__ == "__main__":
    sys.exit(main())
