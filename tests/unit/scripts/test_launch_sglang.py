"""scripts/launch_sglang.py --dry-run prints real SGLang 0.5.23 launch flags for each feature the server uses."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from unittest import mock

from support.sglang_real import sglang_root

ROOT = Path(__file__).resolve().parents[3]


def _sglang_fields() -> set[str]:
    """ServerArgs field names (each is the CLI flag with dashes): sglang/srt/arg_groups/field_order.py."""
    text = (Path(sglang_root()) / "srt" / "arg_groups" / "field_order.py").read_text()
    return set(re.findall(r'^\s+"(\w+)",', text, flags=re.M))


def _dry_run(*args: str, process: bool = False) -> dict[str, str]:
    """The dry run's lines by label: run as a command (`process`), else its main() in this process (a process costs
    ~0.3 s of CPU to import the families; a dry run reads no environment but what the keys test sets)."""
    argv = ["--model-path", "/m", "--dry-run", *args]
    if process:
        stdout = subprocess.run([sys.executable, "-m", "scripts.launch_sglang", *argv], capture_output=True,
                                text=True, check=True, cwd=ROOT, env={"ENGINE_API_KEY": "secret-1"}).stdout
    else:
        from scripts.launch_sglang import main

        with mock.patch.dict(os.environ, {"ENGINE_API_KEY": "secret-1"}), redirect_stdout(io.StringIO()) as out:
            assert main(argv) == 0
        stdout = out.getvalue()
    return {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in stdout.splitlines()}


def test_every_feature_flag_is_a_real_sglang_flag() -> None:
    fields = _sglang_fields()
    lines = _dry_run("--routed-experts", "--keys", process=True)
    engine = lines["engine"]
    for flag in ("--enable-streaming-session", "--enable-return-routed-experts", "--api-key", "--admin-api-key"):
        assert flag in engine.split()
    for flag in re.findall(r"(?<=\s)--([a-z0-9-]+)", engine):
        assert flag.replace("-", "_") in fields, flag
    server = lines["session server"]
    assert "--engine-sessions" in server and "--return-routed-experts" in server
    assert "SESSION_SERVER_ENGINE_API_KEY=" in server and "secret-1" not in engine + server  # keys never printed


def test_plain_launch_has_no_keys_or_routing() -> None:
    lines = _dry_run()
    assert "--api-key" not in lines["engine"] and "--enable-return-routed-experts" not in lines["engine"]
    assert "--return-routed-experts" not in lines["session server"]


def test_a_reasoning_family_gets_its_reasoning_parser() -> None:
    """The engine holds a forced call's grammar back until the reasoning ends only with a reasoning parser
    (session_server/engine/reasoning.py); a family that does not reason gets none."""
    assert _dry_run()["engine"].split()[-2:] == ["--reasoning-parser", "qwen3"]  # the default family
    for family, parser in (("gpt-oss", "gpt-oss"), ("deepseek", "deepseek-r1"), ("deepseek-v4", "deepseek-v4")):
        engine = _dry_run("--model-family", family)["engine"].split()
        assert engine[engine.index("--reasoning-parser") + 1] == parser
    assert "--reasoning-parser" not in _dry_run("--model-family", "llama-3.1")["engine"]
