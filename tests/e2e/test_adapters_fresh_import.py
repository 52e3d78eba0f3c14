"""rollout.adapters imports no trainer: every adapter module loads in a fresh interpreter of the project's venv, where
no trainer is installed, and leaves no trainer (nor torch) in sys.modules; each seam class is built on first use."""

from __future__ import annotations

import subprocess
import sys

ADAPTERS = ("verl", "skyrl", "areal", "slime", "miles", "trl", "nemo_gym")
TRAINERS = ("verl", "skyrl", "areal", "slime", "miles", "trl", "nemo_gym", "torch", "ray")


def test_adapter_modules_import_no_trainer() -> None:
    code = (
        "import sys, rollout, rollout.adapters\n"
        + "".join(f"import rollout.adapters.{name}\n" for name in ADAPTERS)
        + f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({TRAINERS!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
