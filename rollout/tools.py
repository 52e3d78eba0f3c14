"""Tools an agent executes locally: a safe calculator and a key-value lookup, behind one `Toolbox`.

The model only ever sees the tools' OpenAI schemas and their string results; the episode driver hands every
tool call of a turn to `Toolbox.run` and appends one `tool` message per call. Tool failures (bad JSON, an unknown
tool, a division by zero) become the tool's *result* ("error: ..."), as they would in a real agent environment,
so the model can react; they never abort the episode.

The calculator walks the expression's AST instead of calling `eval`: only numbers, parentheses and arithmetic
operators are accepted, and exponents and magnitudes are bounded so a prompt cannot make the trainer hang.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolError(Exception):
    """A tool could not produce a result; its message is what the model reads."""


def evaluate_expression(expression: str) -> int | float:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) without `eval`."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    return _check_magnitude(_eval_node(tree.body))


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE):
            raise ToolError(f"exponent or base too large (|exponent| <= {MAX_EXPONENT})")
        try:
            return _check_magnitude(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError, TypeError) as exc:
            raise ToolError(str(exc)) from None
    raise ToolError(f"unsupported syntax: {type(node).__name__}")


def _check_magnitude(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise ToolError("complex result")
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise ToolError("result out of range")
    return value


def format_number(value: int | float) -> str:
    """Integers as integers, floats without float noise (7.0 -> "7", 0.1+0.2 -> "0.3")."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its OpenAI schema plus the local implementation."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[[dict[str, Any]], str]

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model returned it (arguments are JSON text, exactly as generated)."""

    id: str
    name: str
    arguments: str


def _string_argument(args: dict[str, Any], name: str) -> str:
    """A required string argument; the model reads the ToolError as the call's result and can fix its call."""
    value = args.get(name)
    if not isinstance(value, str):
        raise ToolError(f"argument {name!r} (string) is required")
    return value


def calculator_tool() -> Tool:
    def run(args: dict[str, Any]) -> str:
        return format_number(evaluate_expression(_string_argument(args, "expression")))

    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
            "required": ["expression"],
        },
        fn=run,
    )


def lookup_tool(store: Mapping[str, str]) -> Tool:
    def run(args: dict[str, Any]) -> str:
        key = _string_argument(args, "key")
        if key not in store:
            raise ToolError(f"no entry for key {key!r}")
        return store[key]

    return Tool(
        name="lookup",
        description="Look up the value stored under a key.",
        parameters={"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        fn=run,
    )


class Toolbox:
    """The tools of one episode; `run` executes a turn's tool calls and returns one result string per call."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self._tools = {tool.name: tool for tool in tools}
        if len(self._tools) != len(tools):
            raise ValueError("tool names must be unique")

    @property
    def specs(self) -> list[dict[str, Any]]:
        return [tool.spec for tool in self._tools.values()]

    def call(self, name: str, arguments: str) -> str:
        """Execute one call; any failure becomes an "error: ..." result for the model to read."""
        tool = self._tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r}"
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f"error: arguments are not valid JSON ({exc.msg})"
        if not isinstance(args, dict):
            return "error: arguments must be a JSON object"
        try:
            return tool.fn(args)
        except ToolError as exc:
            return f"error: {exc}"

    async def run(self, calls: Sequence[ToolCall]) -> list[str]:
        """Results of one assistant turn's calls, in order. Async so environments may do I/O."""
        return [self.call(c.name, c.arguments) for c in calls]


def default_toolbox(store: Mapping[str, str] | None = None) -> Toolbox:
    """The calculator plus a lookup over `store`."""
    return Toolbox([calculator_tool(), lookup_tool(dict(store or {}))])
