"""Thinking mode (`ModelFamily.thinking_mode`, which decides the `require_reasoning` the server sends with a grammar)
== SGLang 0.5.23's own decision, for every family's template.

SGLang is the oracle, run in its own venv (support/sglang_thinking_mode.py, one process for all cases): it detects
the reasoning parser and the thinking switch from the family's chat template, as its server does at startup, and
decides a request's mode with `_get_reasoning_from_request`. No engine runs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from support.families import FAMILIES, SGLANG_PARSERS
from trajectory import ModelFamily

HERE = Path(__file__).resolve().parent
KWARGS: list[dict[str, Any] | None] = [
    None, {}, {"enable_thinking": True}, {"enable_thinking": False}, {"thinking": True}, {"thinking": False},
    {"enable_thinking": 0}, {"thinking": 1}, {"enable_thinking": "false"}, {"reasoning_effort": "high"},
]


@pytest.fixture(scope="module")
def sglang_modes(pytestconfig: pytest.Config, tokenizer_dirs: dict[str, Path]) -> dict[str, list[Any]]:
    python = pytestconfig.getoption("--sglang-venv").resolve() / "bin" / "python"
    cases = [{"tokenizer": str(tokenizer_dirs[family]), "kwargs": kwargs} for family in FAMILIES for kwargs in KWARGS]
    out = subprocess.run([str(python), str(HERE.parent / "support" / "sglang_thinking_mode.py")],
                         input=json.dumps(cases), capture_output=True, text=True, check=True, timeout=600)
    answers = json.loads(out.stdout.splitlines()[-1])
    return {family: answers[i * len(KWARGS):(i + 1) * len(KWARGS)] for i, family in enumerate(FAMILIES)}


@pytest.mark.parametrize("name", FAMILIES)
def test_thinking_mode_is_sglangs(families: dict[str, ModelFamily], sglang_modes: dict[str, list[Any]],
                                  name: str) -> None:
    family = families[name]
    parsers = {parser for parser, _ in sglang_modes[name]}
    # The reasoning parser SGLang picks for the template is the table's and the one the family names (the launcher's).
    assert parsers == {SGLANG_PARSERS[name][1]} == {family.sglang_reasoning_parser}
    assert (family.thinking_default is None) is (family.sglang_reasoning_parser is None)
    for kwargs, (_, thinks) in zip(KWARGS, sglang_modes[name], strict=True):
        assert family.thinking_mode(kwargs) is thinks, kwargs
