"""The task (`WeatherGame`): multi-turn, with a tool and a verifiable reward, small enough for a tiny policy to learn
in minutes. Its warm-up demonstrations are laid out token for token as the session server builds an episode."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.episodes import EpisodeResult, Task
from rollout.tools import Tool, Toolbox

# The weather the tool reports -> the one item the user should take for it (each word a single Qwen3 token).
ITEMS = {"sun": "hat", "rain": "coat", "snow": "ski", "cloud": "shirt"}
QUESTION = "wear?"
# The episodes run with thinking off: the token layout the warm-up teaches (`WeatherGame.first`).
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


class UndeclaredToolbox(Toolbox):
    """Tools the policy learned in its warm-up: run as any toolbox, but not declared in the request (no `tools`),
    so the prompt is the user's message alone."""

    @property
    def specs(self) -> list[dict[str, Any]]:
        return []


def weather_tool(weather: str) -> Tool:
    """`weather()`: today's weather, the one fact the answer depends on."""
    return Tool(name="weather", description="Today's weather.", parameters={"type": "object", "properties": {}},
                fn=lambda args: weather)


@dataclass(frozen=True)
class Prompt:
    """One GRPO group's prompt: the user's question, and today's weather, which only the tool reveals."""

    weather: str

    @property
    def answer(self) -> str:
        return ITEMS[self.weather]


class WeatherGame:
    """The user asks what to wear; the model may call `weather` (no arguments), reads the tool's reply and answers
    with one word. The reward is 1 when that word is the item for today's weather (`ITEMS`), else 0.

    Today's weather is drawn per prompt, so the answer cannot be known without the tool: a straight answer is right
    one time in four, an answer after the call as often as the policy maps the weather to its item. The warm-up
    teaches the format, the call and that mapping, and shows both ways to answer, calling first only in a fraction of
    its demonstrations (`p_call`): the starting policy mostly guesses and earns ~0.3. What RL has to find is that
    looking the weather up pays, which a tiny model can learn in a few steps (it is one decision, at the reply's first
    token), unlike a copy of the tool's answer (a sharp phase of supervised learning for a 2-layer model: the
    earlier task, a key-value lookup answered with the value, did not improve in 20 steps).

    The warm-up's token layout is the one the session server builds (Qwen3's template, thinking off): the first
    prompt, the call, the tool's reply as the template appends it, the answer."""

    def __init__(self, tokenizer: Any, max_turns: int = 3) -> None:
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.im_end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True,
                                            add_generation_prompt=True, enable_thinking=False)
        self.first = list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def call_ids(self) -> list[int]:
        return [*self._encode('<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>'), self.im_end]

    def tool_reply_ids(self, weather: str) -> list[int]:
        return self._encode(f"\n<|im_start|>user\n<tool_response>\n{weather}\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n<think>\n\n</think>\n\n")

    def answer_ids(self, answer: str) -> list[int]:
        return [*self._encode(answer), self.im_end]

    def alphabet(self) -> list[int]:
        """Every token any episode of the game can hold when played as taught."""
        ids: set[int] = {self.im_end, *self.first, *self.call_ids()}
        for weather, item in ITEMS.items():
            ids.update(self.tool_reply_ids(weather))
            ids.update(self.answer_ids(item))
        return sorted(ids)

    def prompt(self, rng: random.Random) -> Prompt:
        return Prompt(rng.choice(list(ITEMS)))

    def demonstration(self, prompt: Prompt, rng: random.Random, p_call: float) -> tuple[list[int], list[int]]:
        """A warm-up sequence and its loss mask. Half of them teach the lookup: the call, then the item of the
        weather the tool reported, with the loss off on the call's first token (the choice to call is not taught
        here). The other half teach that choice: the call and its answer with probability `p_call`, a straight
        answer (an item drawn at random, as the weather is unknown) otherwise."""
        lookup = rng.random() < 0.5
        if lookup or rng.random() < p_call:
            call, reply, answer = self.call_ids(), self.tool_reply_ids(prompt.weather), self.answer_ids(prompt.answer)
            ids = [*self.first, *call, *reply, *answer]
            mask = [0] * len(self.first) + [0 if lookup else 1] + [1] * (len(call) - 1) + [0] * len(reply) \
                + [1] * len(answer)
            return ids, mask
        answer = self.answer_ids(rng.choice(list(ITEMS.values())))
        return [*self.first, *answer], [0] * len(self.first) + [1] * len(answer)

    def task(self, prompt: Prompt) -> Task:
        return Task(messages=[{"role": "user", "content": QUESTION}],
                    toolbox=UndeclaredToolbox([weather_tool(prompt.weather)]), max_turns=self.max_turns,
                    metadata={"weather": prompt.weather})

    @staticmethod
    def reward(prompt: Prompt, result: EpisodeResult, index: int = 0) -> float:
        """1 when the final answer is the item for today's weather, however the episode got there."""
        if not result.ok:
            return 0.0
        return float((result.final_answer or "").strip() == prompt.answer)


# A reward: the group's prompt, one episode's result and its index in the group -> a number.
Reward = Callable[[Prompt, EpisodeResult, int], float]
