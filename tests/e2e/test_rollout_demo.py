"""The README's main command, small: the demo starts both processes, prints its summary, writes its files, stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]


def test_demo_writes_samples_and_batch(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    tokenizers = tokenizer_dirs["qwen3"].parent
    cmd = [sys.executable, "-m", "examples.demo", "--tokenizers", str(tokenizers)]  # as `make demo` runs it
    cmd += ["--episodes", "4", "--concurrency", "2", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr

    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == summary["completed"] == summary["correct answers"] == 4
    assert summary["errors"] == 0 and summary["turns"] >= 16
    # One GRPO group of 4 (--group-size 4 by default), two at a time: the server rendered its first request once.
    assert summary["first turns rendered"] == 1 and summary["first turns from cache"] == 3
    for key in ("episodes", "turns", "tokens", "sampled tokens", "mean turns / episode", "chats/s", "errors"):
        assert key in run.stdout  # the printed table
    assert "stopped on SIGTERM: session-server (exit code 0)" in run.stdout

    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(line["episode"] for line in lines) == [0, 1, 2, 3]
    batch = load_file(out / "batch.safetensors")
    assert batch["input_ids"].shape == (4, max(len(line["tokens"]) for line in lines))
    assert int(batch["loss_mask"].sum()) == summary["sampled tokens"] == sum(sum(x["loss_mask"]) for x in lines)
    assert int(batch["attention_mask"].sum()) == summary["tokens"]
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert all(e["stop_reason"] == "final_answer" and e["messages"][-1]["role"] == "assistant" for e in episodes)
