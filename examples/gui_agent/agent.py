"""The GUI agent's episode driver: screenshots in, `click` / `type` tool calls out, samples collected at the end.

One episode = one session on the session server. The agent speaks to it with an official SDK exactly as it would to a
hosted model: the `openai` SDK's Chat Completions (screenshots as data-URL `image_url` parts) or Responses
(`input_image` parts), or the `anthropic` SDK's Messages (screenshots as base64 `image` blocks). Each turn the model
answers with tool calls, the driver applies them to the desktop (examples/gui_agent/desktop.py) in order, answers each
call with a tool result that says what happened, and sends the screen after the turn's actions as a new user message
with the screenshot; a reply without a tool call ends the episode, and so do the token and turn limits. Then the
session's samples are collected with `rollout.SessionClient` and the reward is read from the desktop's state.

Nothing here depends on the emulated engine: with `scripted=True` the driver also writes, into each observation's
text, the `[[sim: ...]]` directive of the desktop's expert action (so that `sglang-sim`, which samples random words,
acts like a competent model and the reward is verifiable), which a real model reads as noise and which is left out
with `scripted=False`; the loop executes whatever tool calls come back either way.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import openai

from examples.gui_agent import desktop as gui
from examples.gui_agent.desktop import Action, Click, Desktop, TypeText
from rollout.client import SessionClient
from sglang_sim import directives
from trajectory import Sample
from trajectory.images import runs

Api = Literal["chat", "responses", "messages"]
Observation = Literal["image", "text"]

SYSTEM = (f"You operate a computer through its screen. Every observation is a {gui.WIDTH}x{gui.HEIGHT} screenshot; "
          "(0, 0) is its top-left corner. Act only with the tools: click(x, y) clicks that pixel, type(text) types "
          "into the focused text field. When the task is done, answer in one short sentence without calling a tool.")
CLICK_DOC = "Click the screen at pixel (x, y); x grows to the right, y downwards."
TYPE_DOC = "Type text into the text field that has the focus (click the field first)."
# Strict schemas: a forced call (`tool_choice` required) is then held to them by the engine's grammar, which keeps an
# untrained model's arguments on the screen
_CLICK_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["x", "y"], "properties": {
    "x": {"type": "integer", "minimum": 0, "maximum": gui.WIDTH - 1},
    "y": {"type": "integer", "minimum": 0, "maximum": gui.HEIGHT - 1}}}
_TYPE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["text"], "properties": {
    "text": {"type": "string", "maxLength": gui.MAX_TEXT}}}
CHAT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "click", "description": CLICK_DOC, "parameters": _CLICK_SCHEMA,
                                      "strict": True}},
    {"type": "function", "function": {"name": "type", "description": TYPE_DOC, "parameters": _TYPE_SCHEMA,
                                      "strict": True}},
]
RESPONSES_TOOLS: list[dict[str, Any]] = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]
ANTHROPIC_TOOLS: list[dict[str, Any]] = [
    {"name": "click", "description": CLICK_DOC, "input_schema": _CLICK_SCHEMA, "strict": True},
    {"name": "type", "description": TYPE_DOC, "input_schema": _TYPE_SCHEMA, "strict": True},
]


@dataclass(frozen=True)
class GuiConfig:
    """How an episode talks to its session."""

    api: Api = "chat"
    observation: Observation = "image"  # "text": the screen described in words, for text-only models
    scripted: bool = True  # write the expert's next action as a sim directive into each observation
    model: str = "default"
    max_turns: int = 12
    max_tokens: int = 256
    temperature: float | None = None
    # "required": every reply must call a tool (a grammar on the engine): an untrained model still clicks and types,
    # so its episodes run to the turn limit with a screenshot a turn
    tool_choice: Literal["auto", "required"] = "auto"
    thinking: bool | None = None  # False: the family's thinking switch off (Qwen3 reasons first by default)
    request_timeout: float = 120.0
    keep_frames: bool = False  # keep every screenshot's PNG on the result (to write them out)


@dataclass
class GuiEpisode:
    """What one episode produced; `error` is set when it failed (the session is deleted either way)."""

    index: int
    seed: int
    word: str
    api: Api
    session_id: str | None = None
    reward: float = 0.0
    turns: int = 0
    actions: int = 0
    screenshots: int = 0  # observations sent as images
    samples: list[Sample] = field(default_factory=list)
    final_answer: str | None = None
    stop_reason: str = "error"
    error: str | None = None
    events: list[str] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list, repr=False)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_action(name: str, arguments: Any) -> Action | str:
    """The desktop action of one tool call, or the text of the error the model gets back (a model may write
    anything: bad JSON, a string "12", a missing argument, an unknown tool)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return f"error: the arguments are not JSON ({exc.msg})"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    if name == "click":
        try:
            return Click(int(arguments["x"]), int(arguments["y"]))
        except (KeyError, TypeError, ValueError):
            return "error: click needs integer arguments x and y"
    if name == "type":
        text = arguments.get("text")
        return TypeText(text) if isinstance(text, str) else "error: type needs a string argument text"
    return f"error: unknown tool {name!r}; the tools are click and type"


def directive(desktop: Desktop) -> str:
    """The `[[sim: ...]]` directive that makes the emulated engine take the expert's next action (or finish)."""
    action = gui.expert_action(desktop)
    if isinstance(action, Click):
        return directives.tool_call("click", x=action.x, y=action.y)
    if isinstance(action, TypeText):
        return directives.tool_call("type", text=action.text)
    return directives.reply(f"Done: the note {desktop.word} is saved.")


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


class _Episode:
    """One episode's desktop and the observations it sends, shared by the three API loops."""

    def __init__(self, result: GuiEpisode, config: GuiConfig) -> None:
        self.result = result
        self.config = config
        self.desktop = gui.new_desktop(result.seed)

    def apply(self, name: str, arguments: Any) -> str:
        """Run one tool call; its result text."""
        action = parse_action(name, arguments)
        if isinstance(action, str):
            self.result.events.append(action)
            return action
        self.desktop = gui.step(self.desktop, action)
        self.result.actions += 1
        self.result.events.append(self.desktop.event)
        return self.desktop.event

    def observation_text(self, first: bool) -> str:
        head = self.desktop.instruction if first else "The screen after your action."
        if self.config.observation == "text":
            head += "\n" + gui.describe(self.desktop)
        return head + (" " + directive(self.desktop) if self.config.scripted else "")

    def screenshot(self) -> bytes | None:
        if self.config.observation != "image":
            return None
        png = gui.screenshot_png(self.desktop)
        self.result.screenshots += 1
        if self.config.keep_frames:
            self.result.frames.append(png)
        return png

    def chat_observation(self, first: bool) -> dict[str, Any]:
        png = self.screenshot()
        text = self.observation_text(first)
        if png is None:
            return {"role": "user", "content": text}
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                            {"type": "text", "text": text}]}

    def responses_observation(self, first: bool) -> dict[str, Any]:
        png = self.screenshot()
        parts: list[dict[str, Any]] = [{"type": "input_image", "image_url": data_url(png)}] if png is not None else []
        return {"role": "user", "content": [*parts, {"type": "input_text", "text": self.observation_text(first)}]}

    def anthropic_observation(self, first: bool) -> list[dict[str, Any]]:
        png = self.screenshot()
        blocks: list[dict[str, Any]] = []
        if png is not None:
            blocks.append({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                       "data": base64.b64encode(png).decode("ascii")}})
        return [*blocks, {"type": "text", "text": self.observation_text(first)}]


async def run_gui_episode(client: SessionClient, seed: int, *, index: int = 0, config: GuiConfig | None = None,
                          http_client: Any = None) -> GuiEpisode:
    """One episode on its own session, to its end. Never raises except on cancellation (the session is deleted)."""
    config = config or GuiConfig()
    episode = _Episode(GuiEpisode(index=index, seed=seed, word=gui.new_desktop(seed).word, api=config.api), config)
    result = episode.result
    started = time.perf_counter()
    try:
        metadata = {"task": "gui", "seed": seed, "word": result.word, "episode": index}
        async with client.session(metadata=metadata) as session_id:
            result.session_id = session_id
            base_url = client.base_url(session_id)
            if config.api == "chat":
                await _chat_loop(episode, base_url, http_client)
            elif config.api == "responses":
                await _responses_loop(episode, base_url, http_client)
            else:
                await _messages_loop(episode, base_url.removesuffix("/v1"), http_client)
            result.samples = await client.collect(session_id)
    except Exception as exc:
        result.stop_reason = "error"
        result.error = f"{type(exc).__name__}: {exc}"
    result.reward = gui.reward(episode.desktop)
    result.seconds = time.perf_counter() - started
    return result


def _sampling(config: GuiConfig) -> dict[str, Any]:
    return {} if config.temperature is None else {"temperature": config.temperature}


async def _chat_loop(episode: _Episode, base_url: str, http_client: Any) -> None:
    config, result = episode.config, episode.result
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, episode.chat_observation(first=True)]
    agent = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=config.request_timeout,
                               http_client=http_client)
    try:
        while result.turns < config.max_turns:
            request: dict[str, Any] = {"model": config.model, "messages": messages, "tools": CHAT_TOOLS,
                                       "max_tokens": config.max_tokens, **_sampling(config)}
            if config.tool_choice == "required":
                request["tool_choice"] = "required"
            if config.thinking is not None:
                request["extra_body"] = {"chat_template_kwargs": {"enable_thinking": config.thinking}}
            completion = await agent.chat.completions.create(**request)
            result.turns += 1
            choice = completion.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if choice.finish_reason == "length":
                result.stop_reason = "length"
                return
            calls = choice.message.tool_calls or []
            if not calls:
                result.final_answer = choice.message.content
                result.stop_reason = "final_answer"
                return
            for call in calls:
                name, arguments = (call.function.name, call.function.arguments) if call.type == "function" else \
                    (call.type, "{}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": episode.apply(name, arguments)})
            messages.append(episode.chat_observation(first=False))
        result.stop_reason = "turn_limit"
    finally:
        if http_client is None:  # a shared pool is its owner's to close
            await agent.close()


async def _responses_loop(episode: _Episode, base_url: str, http_client: Any) -> None:
    """The Responses API with the whole input resent each turn (no `previous_response_id`), as a stateless agent
    does: the reply's output items appended as received, a `function_call_output` per call, then the screen."""
    config, result = episode.config, episode.result
    items: list[dict[str, Any]] = [episode.responses_observation(first=True)]
    agent = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=config.request_timeout,
                               http_client=http_client)
    try:
        while result.turns < config.max_turns:
            request: dict[str, Any] = {"model": config.model, "instructions": SYSTEM, "input": items,
                                       "tools": RESPONSES_TOOLS, "max_output_tokens": config.max_tokens,
                                       "store": False, **_sampling(config)}
            if config.tool_choice == "required":
                request["tool_choice"] = "required"
            if config.thinking is not None:  # Responses' own switch: effort "none" is thinking off
                request["reasoning"] = {"effort": "medium" if config.thinking else "none"}
            response = await agent.responses.create(**request)
            result.turns += 1
            items += [item.model_dump(exclude_none=True) for item in response.output]
            if response.status == "incomplete":
                result.stop_reason = "length"
                return
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                result.final_answer = response.output_text
                result.stop_reason = "final_answer"
                return
            items += [{"type": "function_call_output", "call_id": call.call_id,
                       "output": episode.apply(call.name, call.arguments)} for call in calls]
            items.append(episode.responses_observation(first=False))
        result.stop_reason = "turn_limit"
    finally:
        if http_client is None:
            await agent.close()


async def _messages_loop(episode: _Episode, base_url: str, http_client: Any) -> None:
    import anthropic  # only this loop needs the Anthropic SDK

    config, result = episode.config, episode.result
    messages: list[dict[str, Any]] = [{"role": "user", "content": episode.anthropic_observation(first=True)}]
    request: dict[str, Any]
    agent = anthropic.AsyncAnthropic(base_url=base_url, api_key="EMPTY", max_retries=0,
                                     timeout=config.request_timeout, http_client=http_client)
    try:
        while result.turns < config.max_turns:
            request = {"model": config.model, "max_tokens": config.max_tokens, "system": SYSTEM,
                       "messages": messages, "tools": ANTHROPIC_TOOLS, **_sampling(config)}
            if config.tool_choice == "required":
                request["tool_choice"] = {"type": "any"}
            if config.thinking is not None:
                request["thinking"] = {"type": "enabled", "budget_tokens": 1024} if config.thinking else \
                    {"type": "disabled"}
            message = await agent.messages.create(**request)
            result.turns += 1
            content = [block.model_dump(exclude_none=True) for block in message.content]
            messages.append({"role": "assistant", "content": content})
            if message.stop_reason == "max_tokens":
                result.stop_reason = "length"
                return
            uses = [b for b in message.content if b.type == "tool_use"]
            if not uses:
                result.final_answer = "".join(b.text for b in message.content if b.type == "text")
                result.stop_reason = "final_answer"
                return
            results = [{"type": "tool_result", "tool_use_id": use.id, "content": episode.apply(use.name, use.input)}
                       for use in uses]
            messages.append({"role": "user", "content": [*results, *episode.anthropic_observation(first=False)]})
        result.stop_reason = "turn_limit"
    finally:
        if http_client is None:
            await agent.close()


async def run_gui_episodes(client: SessionClient, seeds: Sequence[int], *, concurrency: int = 4,
                           config: GuiConfig | Sequence[GuiConfig] | None = None,
                           on_result: Callable[[GuiEpisode], None] | None = None) -> list[GuiEpisode]:
    """One episode per seed (with one config for all, or one config per seed), at most `concurrency` at once, over
    one shared connection pool; the results in seed order."""
    configs = list(config) if isinstance(config, Sequence) else [config or GuiConfig()] * len(seeds)
    if len(configs) != len(seeds):
        raise ValueError("one config per seed, or a single config")
    gate = asyncio.Semaphore(max(1, concurrency))
    timeout = max((c.request_timeout for c in configs), default=120.0)
    pools = {api: _http_pool(api, timeout) for api in {c.api for c in configs}}  # each SDK brings its own httpx

    async def one(index: int, seed: int, cfg: GuiConfig) -> GuiEpisode:
        async with gate:
            result = await run_gui_episode(client, seed, index=index, config=cfg, http_client=pools[cfg.api])
        if on_result is not None:
            on_result(result)
        return result

    try:
        jobs = (one(i, s, c) for i, (s, c) in enumerate(zip(seeds, configs, strict=True)))
        return list(await asyncio.gather(*jobs))
    finally:
        for pool in pools.values():
            await pool.aclose()


def _http_pool(api: Api, timeout: float) -> Any:
    """The connection pool an API's SDK accepts (the `anthropic` SDK's is not `httpx`'s class)."""
    if api != "messages":
        return openai.DefaultAsyncHttpxClient(timeout=timeout)
    import anthropic

    return anthropic.DefaultAsyncHttpxClient(timeout=timeout)


def pad_runs(tokens: Sequence[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `pad_id` in `tokens`: where each image's placeholder ids sit in a sample,
    read from the token ids themselves (a check that does not trust the sample's own image records)."""
    return [(a, b - a) for a, b in runs(np.asarray(tokens), pad_id)]
