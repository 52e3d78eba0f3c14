"""`make demo-cluster`, small: two engines, three replicas, nginx; the episodes run through the balancer's one URL,
every replica serves some of them, and each replica's own /metrics agree with what the clients saw, with no error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_cluster_runs_clean(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "examples.demo_cluster", "--tokenizers", str(tokenizer_dirs["qwen3"].parent)]
    cmd += ["--episodes", "12", "--concurrency", "6", "--replicas", "3", "--engines", "2", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "errors: 0; per-replica counts agree with what the clients saw" in run.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == summary["completed"] == summary["correct answers"] == 12
    replicas = summary["replicas"]
    assert sorted(replicas) == ["r0", "r1", "r2"]
    assert sum(r["sessions created"] for r in replicas.values()) == 12
    assert sum(r["chats"] for r in replicas.values()) == summary["turns"]
    assert all(r["sessions created"] >= 2 and r["5xx"] == 0 and r["live sessions"] == 0 for r in replicas.values())
