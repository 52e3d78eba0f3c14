"""The tool-call constraint each family sends the engine == the one SGLang 0.5.23's own chat endpoint sends.

SGLang itself is the oracle, run in its own venv (support/sglang_tool_constraint.py, one process for all cases): for
every family, with the family's tool-call detector and reasoning parser, for `tool_choice` required and a named
function, parallel calls on and off, tools with and without `strict`, and auto with parallel calls off. The only
differences are ours on purpose, each checked to be exactly that:
- JSON-arguments families (SGLang's legacy tag): a named choice constrains only the named tool (SGLang's tag lists
  every tool), and parallel calls off is xgrammar's `triggered_tags` with `stop_after_first` (SGLang's legacy tag
  cannot cap the calls); SGLang sends auto unconstrained there (no model-native tag).
- harmony: a forced choice forces a call (xgrammar 0.2.7's tag admits none: `at_least_one` false, or `optional`).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from session_server.frontend.fields import RequestOptions, ToolChoice, tool_call_constraint
from support.families import FAMILIES
from support.families import SGLANG_PARSERS as PARSERS
from trajectory.families import registry

HERE = Path(__file__).resolve().parent
ADD = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string", "description": "naïve 東京"}}}}}
STRICT = {"type": "function", "function": {**LOOKUP["function"], "name": "strict_lookup", "strict": True}}
CHOICES: list[Any] = ["required", {"type": "function", "function": {"name": "lookup"}}, "auto"]


def _cases() -> list[dict[str, Any]]:
    return [{"family": family, "parser": PARSERS[family][0], "reasoning_parser": PARSERS[family][1], "tools": tools,
             "tool_choice": choice, "parallel": parallel}
            for family in FAMILIES for tools in ([ADD, LOOKUP], [ADD, LOOKUP, STRICT]) for choice in CHOICES
            for parallel in (True, False) if choice != "auto" or not parallel]


@pytest.fixture(scope="module")
def sglang_constraints(pytestconfig: pytest.Config) -> list[tuple[str, Any]]:
    python = pytestconfig.getoption("--sglang-venv").resolve() / "bin" / "python"
    cases = json.dumps(_cases())
    out = subprocess.run([str(python), str(HERE.parent / "support" / "sglang_tool_constraint.py")], input=cases,
                         capture_output=True, text=True, check=True, timeout=600)
    answers = json.loads(out.stdout.splitlines()[-1])
    return [(key, None if value is None else json.loads(value)) for key, value in answers]


def _ours(family: str, case: dict[str, Any]) -> tuple[str, Any] | None:
    choice = case["tool_choice"]
    mode = ToolChoice("function", choice["function"]["name"]) if isinstance(choice, dict) else ToolChoice(choice)
    options = RequestOptions(tool_choice=mode, parallel_tool_calls=case["parallel"])
    fam = registry._FAMILIES[family]  # the class: its format attributes, no tokenizer needed
    constraint = tool_call_constraint(case["tools"], options, fam.tool_call_structure, fam.structural_tag_format)
    return None if constraint is None else (constraint[0], json.loads(constraint[1]))


def _as_sglang_would(family: str, case: dict[str, Any], theirs: Any) -> Any:
    """SGLang's constraint with our deliberate differences applied (see the module docstring)."""
    fam, theirs = registry._FAMILIES[family], copy.deepcopy(theirs)
    named = case["tool_choice"]["function"]["name"] if isinstance(case["tool_choice"], dict) else None
    if fam.tool_call_structure is not None and "structures" in theirs:
        if named is not None:
            theirs["structures"] = [s for s in theirs["structures"] if f'"{named}"' in s["begin"]
                                    or f"｜>{named}\n" in s["begin"]]
        if not case["parallel"]:
            theirs = {"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": theirs["triggers"],
                "tags": [{"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
                          "end": s["end"]} for s in theirs["structures"]],
                "at_least_one": theirs["at_least_one"], "stop_after_first": True}}
    if family == "gpt-oss" and case["tool_choice"] != "auto":
        fmt = theirs["format"]
        theirs["format"] = fmt = fmt["content"] if fmt["type"] == "optional" else fmt
        fmt["at_least_one"] = True
    return theirs


def test_each_familys_tool_constraint_is_sglangs(sglang_constraints: list[tuple[str, Any]]) -> None:
    cases = _cases()
    assert len(sglang_constraints) == len(cases)
    for case, (key, theirs) in zip(cases, sglang_constraints, strict=True):
        family = case["family"]
        ours = _ours(family, case)
        label = (family, json.dumps(case["tool_choice"]), case["parallel"], len(case["tools"]))
        if case["tool_choice"] == "auto" and registry._FAMILIES[family].structural_tag_format is None:
            continue  # SGLang leaves it unconstrained; ours caps the calls (the legacy case above)
        assert ours is not None and ours[0] == key, (label, ours, key)
        assert ours[1] == _as_sglang_would(family, case, theirs), label
