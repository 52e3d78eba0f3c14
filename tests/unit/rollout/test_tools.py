"""The agent's local tools: the AST calculator refuses everything but arithmetic; failures become tool results."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.tools import ToolCall, ToolError, default_toolbox, evaluate_expression, format_number


@pytest.mark.parametrize(
    ("expression", "expected"),
    [("2 + 3 * 4", 14), ("(1 + 2) / 4", 0.75), ("-7 // 2", -4), ("7 % 3", 1), ("2 ** 10", 1024), ("-(3 - 5)", 2)],
)
def test_calculator_arithmetic(expression: str, expected: float) -> None:
    assert evaluate_expression(expression) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",  # calls
        "x + 1",  # names
        "(1).real",  # attributes
        "[1, 2]",  # containers
        "'a' * 3",  # strings
        "True + 1",  # bools are not numbers here
        "2 ** 1000",  # bounded exponent
        "9 ** 9 ** 9",  # nested power bombs
        "1e200 * 1e200",  # overflow to inf
        "1e20 * 1e20",  # magnitude bound
        "1 / 0",
        "(-8) ** 0.5",  # complex
        "1 +",  # syntax
        "1" * 300,  # length limit
    ],
)
def test_calculator_refuses(expression: str) -> None:
    with pytest.raises(ToolError):
        evaluate_expression(expression)


def test_format_number_hides_float_noise() -> None:
    assert [format_number(v) for v in (7.0, 0.1 + 0.2, 3, 2.5)] == ["7", "0.3", "3", "2.5"]


def test_toolbox_turns_failures_into_results() -> None:
    box = default_toolbox({"price:fig": "4"})
    calls = [
        ToolCall("a", "lookup", json.dumps({"key": "price:fig"})),
        ToolCall("b", "calculator", json.dumps({"expression": "4 * 3"})),
        ToolCall("c", "lookup", json.dumps({"key": "missing"})),
        ToolCall("d", "calculator", "{not json"),
        ToolCall("e", "calculator", "[1]"),
        ToolCall("f", "shell", "{}"),
        ToolCall("g", "calculator", "{}"),
    ]
    results = asyncio.run(box.run(calls))
    assert results[:2] == ["4", "12"]
    assert all(r.startswith("error: ") for r in results[2:])
    assert "'missing'" in results[2] and "'shell'" in results[5]


def test_toolbox_specs_are_openai_function_tools() -> None:
    specs = default_toolbox().specs
    assert [s["function"]["name"] for s in specs] == ["calculator", "lookup"]
    for spec in specs:
        assert spec["type"] == "function"
        assert spec["function"]["parameters"]["type"] == "object"
        assert spec["function"]["parameters"]["required"]
