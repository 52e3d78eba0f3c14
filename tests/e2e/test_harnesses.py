"""The real coding harnesses, unmodified, from their npm packages: Codex CLI (`codex exec`, the Responses API) and
Claude Code (`claude -p`, the Anthropic Messages API), each running a tool-using task against the session server
and `sglang-sim`.

The emulated model is scripted by the task: its first reply calls the harness's own shell tool (Codex's
`exec_command`, Claude Code's `Bash`) with a command that writes a file and prints the next directive, so the tool
result scripts the final answer. The harness runs the command itself; the test checks the file it wrote, the answer
it reported, and that the session holds exactly what the engine saw and sampled (two streamed turns, no rollback,
the loss mask exactly on the sampled tokens).

`make harnesses` installs the pinned npm packages into .cache/harnesses (`make test` does it first); without them
these tests are skipped with that instruction. The settings that keep each harness on loopback (no plugins, no
analytics, no update checks, no nonessential traffic) are the ones the harness documents.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sglang_sim.directives import tool_call
from support.server import assert_training_data, new_session
from support.stack import Stack, StackFactory

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".cache" / "harnesses" / "node_modules" / ".bin"
ANSWER = "Done: out.txt holds hello."
# The command prints the final answer's directive, split in the task's own text so the task does not script it.
COMMAND = f"printf hello > out.txt && echo '[[sim: ''reply {ANSWER}]]'"


def _binary(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: run `make harnesses` (npm packages into .cache/harnesses)")
    return path


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    # One engine event per token: the turns reach the harness in many stream events, as from a GPU.
    with stack_factory(family="qwen3", sim_args=["--token-latency-ms", "1", "--stream-interval", "1"],
                       servers={"server": []}, proxied={"server"}) as stack:
        yield stack


def _env(**extra: str) -> dict[str, str]:
    """A clean environment: PATH and HOME of this process, nothing of the test runner's own settings."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", **extra}


def _check_session(stack: Stack, sid: str) -> dict[str, Any]:
    info = assert_training_data(stack, sid, model_calls=2, streamed=True)
    first, second = (record["message"] for record in info["records"])
    assert first["tool_calls"] and second["content"] == ANSWER
    assert httpx.delete(f"{stack.server}/sessions/{sid}", timeout=30).status_code == 204
    return info


def test_codex_exec_runs_its_shell_tool_through_the_responses_api(stack: Stack, tmp_path: Path) -> None:
    codex = _binary("codex")
    sid = new_session(stack.server, {"harness": "codex"})
    work, home = tmp_path / "work", tmp_path / "codex-home"
    work.mkdir()
    home.mkdir()
    provider = (f'model_providers.local={{name="local",base_url="{stack.server}/sessions/{sid}/v1",'
                'env_key="LOCAL_API_KEY",wire_api="responses"}')
    task = f"Write hello into out.txt. {tool_call('exec_command', cmd=COMMAND)}"
    proc = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "--ephemeral", "--json", "-s", "workspace-write",
         "-c", "model_provider=local", "-c", "model=qwen3", "-c", provider, "-c", "features.plugins=false",
         "-c", "analytics.enabled=false", "-c", "check_for_update_on_startup=false", task],
        cwd=work, env=_env(CODEX_HOME=str(home), LOCAL_API_KEY="unused"), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=180, check=False)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (proc.stderr[-2000:], events[-5:])
    assert (work / "out.txt").read_text() == "hello"
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages[-1] == ANSWER, events
    assert not [e for e in events if e.get("type") in ("error", "turn.failed")]
    _check_session(stack, sid)


def test_claude_code_runs_its_bash_tool_through_the_messages_api(stack: Stack, tmp_path: Path) -> None:
    claude = _binary("claude")
    sid = new_session(stack.server, {"harness": "claude-code"})
    work, config = tmp_path / "work", tmp_path / "claude-config"
    work.mkdir()
    config.mkdir()
    task = f"Write hello into out.txt. {tool_call('Bash', command=COMMAND, description='Write the file')}"
    proc = subprocess.run(
        [str(claude), "-p", task, "--output-format", "json", "--dangerously-skip-permissions"],
        cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180, check=False,
        env=_env(CLAUDE_CONFIG_DIR=str(config), ANTHROPIC_BASE_URL=f"{stack.server}/sessions/{sid}",
                 ANTHROPIC_API_KEY="unused", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
                 DISABLE_TELEMETRY="1", CLAUDE_CODE_MAX_RETRIES="2", IS_SANDBOX="1",
                 # Claude Code asks for 128000 output tokens by default: more than the model's context leaves, which
                 # SGLang (and so the server) refuses. Its own setting brings it within the context.
                 CLAUDE_CODE_MAX_OUTPUT_TOKENS="4096"))
    assert proc.returncode == 0, (proc.stderr[-2000:], proc.stdout[-3000:])
    result = json.loads(proc.stdout)
    # Claude Code exits 0 even when it refused a tool call: the denials are in the result.
    assert result["is_error"] is False and result["permission_denials"] == [], result
    assert result["result"] == ANSWER, result
    assert (work / "out.txt").read_text() == "hello"
    _check_session(stack, sid)
