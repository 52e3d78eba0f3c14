"""Tool-using tasks scripted for the emulated engine (`sglang-sim`), used by the demo and the tests.

`sglang-sim` replies according to directives in the prompt (the last directive-bearing message wins):
`[[sim: tool_call name=NAME args=JSON]]` makes the model call a tool (repeat it for parallel calls),
`[[sim: think]]` adds reasoning and `[[sim: reply TEXT]]` gives a fixed answer. A task here is a small shopping
sum: the user message asks for it and directs the first tool calls (lookups of a price and a quantity); the
environment then appends the next directive to the last tool result of each turn (look up the next item, call the
calculator, answer), so the episode is a real tool loop of several turns whose tools run locally and whose final
answer can be checked against the expected value. The agent itself stays generic: it only executes the tool calls
that come back, exactly as with a real model.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rollout.episodes import Task
from rollout.tools import Tool, Toolbox, ToolCall, calculator_tool, lookup_tool
from sglang_sim import directives

ITEMS = ("apple", "pear", "plum", "fig", "kiwi", "lime", "date", "melon")


tool_call_directive = directives.tool_call
reply_directive = directives.reply
THINK = directives.THINK


class ScriptedToolbox(Toolbox):
    """A toolbox whose environment appends the next scripted directive to the last tool result of each turn."""

    def __init__(self, tools: Sequence[Tool], script: Sequence[str]) -> None:
        super().__init__(tools)
        self._script = list(script)
        self._turn = 0

    async def run(self, calls: Sequence[ToolCall]) -> list[str]:
        results = await super().run(calls)
        if results and self._turn < len(self._script):
            results[-1] = f"{results[-1]}\n{self._script[self._turn]}"
        self._turn += 1
        return results


def shopping_task(
    rng: random.Random, index: int = 0, max_turns: int = 10, scripted: bool = True
) -> tuple[Task, str]:
    """A task and the final answer the episode must end with.

    Shapes (chosen at random): 2 or 3 items; the lookups of an item run as parallel calls in one turn or one
    per turn; optional reasoning. That gives 4 to 8 turns per episode. With `scripted=False` the prompt and the
    tool results carry no directives: the same task for a real model.
    """
    items = rng.sample(ITEMS, rng.choice((2, 3)))
    prices = {item: rng.randint(1, 20) for item in items}
    quantities = {item: rng.randint(1, 9) for item in items}
    store = {f"price:{i}": str(prices[i]) for i in items} | {f"quantity:{i}": str(quantities[i]) for i in items}
    total = sum(prices[i] * quantities[i] for i in items)
    expression = " + ".join(f"{prices[i]} * {quantities[i]}" for i in items)
    answer = f"The total is {total}."
    think = THINK + " " if rng.random() < 0.5 else ""
    parallel = rng.random() < 0.5

    steps: list[str] = []  # directive for turn 1 (in the user message), then one per tool turn
    for item in items:
        price = tool_call_directive("lookup", key=f"price:{item}")
        quantity = tool_call_directive("lookup", key=f"quantity:{item}")
        steps.extend([price + " " + quantity] if parallel else [price, quantity])
    steps.append(think + tool_call_directive("calculator", expression=expression))
    steps.append(reply_directive(answer))

    if not scripted:
        think, steps = "", []
    user = (
        f"Task {index}: what do {', '.join(items)} cost in total? Look up each price and quantity, then compute "
        f"the sum with the calculator. {think}{steps[0] if steps else ''}"
    ).rstrip()
    messages = [
        {"role": "system", "content": "You are a careful shopping assistant. Use the tools; answer briefly."},
        {"role": "user", "content": user},
    ]
    toolbox = ScriptedToolbox([calculator_tool(), lookup_tool(store)], steps[1:])
    metadata = {"task": "shopping", "index": index, "expected": answer}
    return Task(messages=messages, toolbox=toolbox, max_turns=max_turns, metadata=metadata), answer


def shopping_tasks(
    count: int, seed: int = 0, max_turns: int = 10, scripted: bool = True
) -> list[tuple[Task, str]]:
    """`count` reproducible tasks with their expected final answers."""
    rng = random.Random(seed)
    return [shopping_task(rng, index, max_turns, scripted) for index in range(count)]
