"""The README's main command: agent episodes through the session server, written out as training data.

Starts `sglang-sim` (the emulated SGLang engine) and `session-server` on free loopback ports, runs tool-using
episodes with the official `openai` client (one session each; tools run locally), prints a summary, writes the
trajectories under `--out` (JSONL of samples, a padded safetensors batch, the episode transcripts), and stops both
processes.

    python -m examples.demo --tokenizers .cache/tokenizers
    python -m examples.demo --engine-url http://gpu-host:30000 --tokenizer /models/Qwen3-8B   # a real SGLang
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from harness.launchers import LOOPBACK, ProcessCrashed, RunningProcess, free_port, start_session_server, start_sim
from harness.scripted_tasks import shopping_tasks
from rollout.client import SessionClient
from rollout.episodes import AgentConfig, EpisodeResult, Task, run_episodes
from trajectory import family_names, samples_to_json

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--episodes", type=int, default=64, help="number of agent episodes (default 64)")
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight at once (default 16)")
    p.add_argument("--group-size", type=int, default=4, metavar="G",
                   help="episodes per task, launched one after another as a GRPO trainer samples a group\n"
                        "(they open with the same request: the server renders it once; default 4)")
    p.add_argument("--model-family", default="qwen3", metavar="NAME",
                   help=f"model family, one of: {', '.join(family_names())} (default %(default)s)")
    p.add_argument("--tokenizers", type=Path, default=ROOT / ".cache" / "tokenizers",
                   help="directory with one tokenizer directory per family (`make tokenizers` builds it)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory of the served model (default: TOKENIZERS/MODEL_FAMILY)")
    p.add_argument("--engine-url", default=None,
                   help="use this real SGLang server instead of starting the emulated engine\n"
                        "(see scripts/launch_sglang.py); the tasks then carry no sim directives")
    p.add_argument("--model", default="default", help="model name sent in chat requests (default 'default')")
    p.add_argument("--max-tokens", type=int, default=256, help="max tokens per reply (default 256)")
    p.add_argument("--max-turns", type=int, default=10, help="turn limit per episode (default 10)")
    p.add_argument("--token-latency-ms", type=float, default=0.0,
                   help="per-token latency of the emulated engine (default 0)")
    p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    p.add_argument("--out", type=Path, default=ROOT / "out", help="output folder, git-ignored (default out/)")
    p.add_argument("--journal", type=Path, default=None,
                   help="run the session server with --journal PATH (SQLite, read with sqlite3: docs/operating.md)")
    return p.parse_args(argv)


@contextlib.contextmanager
def services(args: argparse.Namespace, tokenizer: Path, log_dir: Path) -> Iterator[tuple[str, list[RunningProcess]]]:
    """Start the engine (unless --engine-url) and the session server; stop them in reverse order on exit."""
    started: list[RunningProcess] = []
    try:
        engine_url = args.engine_url
        if engine_url is None:  # a port picked here, so that both processes start at once
            port = free_port()
            extra = ["--port", str(port), "--token-latency-ms", str(args.token_latency_ms)]
            started.append(start_sim(tokenizer, args.model_family, *extra, log_dir=log_dir, wait=False))
            engine_url = f"http://{LOOPBACK}:{port}"
        journal = ["--journal", str(args.journal)] if args.journal is not None else []
        started.append(start_session_server(engine_url, tokenizer, args.model_family, *journal, log_dir=log_dir,
                                            wait=False))
        for proc in started:
            proc.wait_ready()
            print(f"{proc.name:<20} {proc.url}")
        print(f"process logs in {log_dir}")
        yield started[-1].url, started
    finally:
        for proc in reversed(started):
            code = proc.stop()
            how = "killed after the SIGTERM grace period" if proc.killed else "stopped on SIGTERM"
            print(f"{how}: {proc.name} (exit code {code})")


def grouped_tasks(args: argparse.Namespace) -> list[tuple[Task, str]]:
    """`--episodes` tasks in groups of `--group-size` identical ones (each its own objects: a toolbox keeps an
    episode's state), a group's episodes next to each other so they run together."""
    prompts = -(-args.episodes // args.group_size)
    copies = [shopping_tasks(prompts, seed=args.seed, max_turns=args.max_turns, scripted=args.engine_url is None)
              for _ in range(args.group_size)]
    return [copies[g][p] for p in range(prompts) for g in range(args.group_size)][: args.episodes]


async def first_turn_counts(server_url: str) -> dict[str, int]:
    """The server's first-turn cache counts (`/metrics`): rendered, and served from the cache."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{server_url}/metrics")).text
    values = {s.name: int(s.value) for f in text_string_to_metric_families(text) for s in f.samples}
    return {"first turns rendered": values.get("session_server_first_turn_cache_misses_total", 0),
            "first turns from cache": values.get("session_server_first_turn_cache_hits_total", 0)}


async def run(args: argparse.Namespace, server_url: str) -> tuple[list[EpisodeResult], list[str], float]:
    pairs = grouped_tasks(args)
    tasks, expected = [t for t, _ in pairs], [a for _, a in pairs]
    config = AgentConfig(model=args.model, max_tokens=args.max_tokens)
    async with SessionClient(server_url) as client:
        await client.health()
        with tqdm(total=len(tasks), desc="episodes", unit="ep", dynamic_ncols=True) as bar:
            errors = 0

            def progress(result: EpisodeResult) -> None:
                nonlocal errors
                errors += not result.ok
                bar.set_postfix(turns=result.turns, errors=errors, refresh=False)
                bar.update()

            started = time.perf_counter()
            results = await run_episodes(client, tasks, concurrency=args.concurrency, config=config,
                                         on_result=progress)
            elapsed = time.perf_counter() - started
    return results, expected, elapsed


def summarize(results: list[EpisodeResult], expected: list[str], elapsed: float, scripted: bool,
              first_turns: dict[str, int] | None = None) -> dict[str, Any]:
    samples = [s for r in results for s in r.samples]
    turns = sum(r.turns for r in results)
    summary: dict[str, Any] = {
        "episodes": len(results),
        "completed": sum(r.ok for r in results),
        "errors": sum(not r.ok for r in results),
        "turns": turns,
        "tool calls": sum(r.tool_calls for r in results),
        "samples": len(samples),
        "tokens": sum(len(s.tokens) for s in samples),
        "sampled tokens": int(sum(int(s.loss_mask.sum()) for s in samples)),
        "mean turns / episode": round(turns / max(1, len(results)), 2),
        "seconds": round(elapsed, 2),
        "chats/s": round(turns / elapsed, 1) if elapsed else 0.0,
        "episodes/s": round(len(results) / elapsed, 1) if elapsed else 0.0,
        "503 retries": sum(r.busy_retries for r in results),
    }
    if scripted:
        summary["correct answers"] = sum(r.final_answer == e for r, e in zip(results, expected, strict=True))
    summary.update(first_turns or {})
    return summary


def print_table(summary: dict[str, Any]) -> None:
    width = max(map(len, summary))
    rule = "-" * (width + 14)
    print(rule)
    for key, value in summary.items():
        print(f"{key:<{width}}  {value:>11}")
    print(rule)


def write_outputs(out: Path, results: list[EpisodeResult], pad_id: int) -> list[Path]:
    """samples.jsonl (one sample per line), batch.safetensors (padded tensors), episodes.jsonl (transcripts)."""
    from safetensors.torch import save_file

    from rollout.torch_batch import to_torch_batch

    out.mkdir(parents=True, exist_ok=True)
    samples_path, batch_path, episodes_path = out / "samples.jsonl", out / "batch.safetensors", out / "episodes.jsonl"
    with samples_path.open("w") as f:
        for r in results:
            for line in samples_to_json(r.samples):
                f.write(json.dumps({"episode": r.index, "session_id": r.session_id, **line}) + "\n")
    with episodes_path.open("w") as f:
        for r in results:
            f.write(json.dumps({
                "episode": r.index, "session_id": r.session_id, "server": r.server, "turns": r.turns,
                "tool_calls": r.tool_calls, "stop_reason": r.stop_reason, "final_answer": r.final_answer,
                "error": r.error, "seconds": round(r.seconds, 3), "messages": r.messages,
            }, default=str) + "\n")
    written = [samples_path, episodes_path]
    samples = [s for r in results for s in r.samples]
    if samples:
        batch = to_torch_batch(samples, pad_id)
        episodes = [r.index for r in results for _ in r.samples]
        save_file(batch, str(batch_path), metadata={"episodes": json.dumps(episodes), "pad_id": str(pad_id)})
        written.insert(1, batch_path)
    return written


def pad_id_of(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return int(pad if pad is not None else 0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = args.tokenizer or args.tokenizers / args.model_family
    if not (tokenizer / "tokenizer_config.json").exists():
        print(f"error: no tokenizer in {tokenizer} (run `make tokenizers`, or pass --tokenizer DIR)", file=sys.stderr)
        return 2
    if args.episodes < 1 or args.concurrency < 1 or args.group_size < 1:
        print("error: --episodes, --concurrency and --group-size must be >= 1", file=sys.stderr)
        return 2
    try:
        with services(args, tokenizer, args.out / "logs") as (server_url, _):
            results, expected, elapsed = asyncio.run(run(args, server_url))
            first_turns = asyncio.run(first_turn_counts(server_url))
    except (ProcessCrashed, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = summarize(results, expected, elapsed, scripted=args.engine_url is None, first_turns=first_turns)
    print_table(summary)
    failed = [r for r in results if not r.ok]
    for r in failed[:5]:
        print(f"episode {r.index} failed: {r.error}", file=sys.stderr)
    written = write_outputs(args.out, results, pad_id_of(tokenizer))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("wrote " + ", ".join(str(p.relative_to(Path.cwd()) if p.is_relative_to(Path.cwd()) else p) for p in written))
    if args.journal is not None:
        print(journal_summary(args.journal))
    return 1 if failed else 0


def journal_summary(path: Path) -> str:
    """Rows and size of the server's journal (every episode deleted its session: only tombstones are left)."""
    from session_server.sessions.journal import file_bytes, table_rows

    rows, size = table_rows(path), file_bytes(path)
    return f"journal {path}: {size / 1024:.0f} KiB, " + ", ".join(f"{n} {t}" for t, n in rows.items())


if __name__ == "__main__":
    sys.exit(main())
