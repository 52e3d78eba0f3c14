"""The agent-episode driver: N concurrent tool-using episodes, each on its own session, spoken to via `openai`.

An episode is what an RL environment produces for one prompt: a session is created, the official
`openai.AsyncOpenAI` client is pointed at the session's base URL, and a plain multi-turn tool loop runs against it
(the assistant message is appended exactly as returned, every tool call is executed locally by the task's
`Toolbox`, one `tool` message per call) until the model answers without tool calls, the reply is cut by the
token limit, or the turn limit is reached. Then the samples are collected and the session deleted.

A GRPO group (G episodes of one prompt) may run as forks (`run_group`, `run_episodes(fork_groups=G)`): one session is
primed with the prompt (rendered and tokenized once) and forked into G children, each an episode's session.

Nothing here knows about the emulated engine: the loop executes whatever tool calls come back, so the same code
drives a real model. Failures are part of the result, never dropped: every episode yields an `EpisodeResult`,
with `error` set when it failed (the session is deleted either way); an episode the infrastructure failed (a 5xx,
a lost connection: rollout/infrastructure.py) keeps the samples its session holds, marked aborted. A turn answered
503 (server paused for a weight update) is retried after the server's `Retry-After`, a bounded number of times.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import openai

from rollout.client import SampleFormat, SessionClient, parse_retry_after
from rollout.infrastructure import collect_after_failure
from rollout.tools import Toolbox, ToolCall
from trajectory import Sample

T = TypeVar("T")
StopReason = Literal["final_answer", "length", "turn_limit", "error"]


@dataclass
class Task:
    """One episode's prompt: the opening messages, the tools the agent may call, and a turn limit."""

    messages: list[dict[str, Any]]
    toolbox: Toolbox
    max_turns: int = 8
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentConfig:
    """How episodes talk to their sessions."""

    model: str = "default"
    api_key: str = "EMPTY"
    temperature: float | None = None
    max_tokens: int | None = None
    extra_body: dict[str, Any] | None = None
    request_timeout: float = 300.0
    busy_retries: int = 5  # 503 retries per turn
    max_retry_after: float = 30.0  # cap on one wait, whatever the server asks
    default_retry_after: float = 1.0  # when a 503 carries no Retry-After
    max_seq_len: int | None = None
    sample_format: SampleFormat = "safetensors"


@dataclass
class EpisodeResult:
    """What one episode produced; `error` is set (and `stop_reason` is "error") when it failed."""

    index: int
    session_id: str | None = None
    server: str | None = None
    samples: list[Sample] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    busy_retries: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    final_answer: str | None = None
    stop_reason: StopReason = "error"
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


async def run_episode(
    client: SessionClient,
    task: Task,
    *,
    index: int = 0,
    config: AgentConfig | None = None,
    http_client: openai.DefaultAsyncHttpxClient | None = None,
    session_id: str | None = None,
) -> EpisodeResult:
    """Run one episode to its end. Never raises except on cancellation (which still deletes the session).
    `session_id`: a session already made for it (a forked group's child, `run_group`), else a new one is created;
    either way it is deleted at the end."""
    config = config or AgentConfig()
    result = EpisodeResult(index=index, messages=[dict(m) for m in task.messages])
    started = time.perf_counter()
    holder = client.session(metadata={**task.metadata, "episode": index}) if session_id is None \
        else client.held(session_id)
    try:
        async with holder as session_id:
            result.session_id = session_id
            result.server = client.server_of(session_id)
            agent = openai.AsyncOpenAI(
                base_url=client.base_url(session_id),
                api_key=config.api_key,
                max_retries=0,
                timeout=config.request_timeout,
                http_client=http_client,
            )
            try:
                await _tool_loop(agent, task, config, result)
                result.samples = await client.collect(session_id, config.max_seq_len, config.sample_format)
            except Exception as exc:  # the infrastructure's failure: the samples so far, marked (infrastructure.py)
                result.samples = await collect_after_failure(client, session_id, exc, config.max_seq_len,
                                                             config.sample_format) or []
                raise
            finally:
                if http_client is None:  # the agent owns its connections only when none were shared
                    await agent.close()
    except Exception as exc:
        result.stop_reason = "error"
        result.error = f"{type(exc).__name__}: {exc}"
        result.exception = exc
    result.seconds = time.perf_counter() - started
    return result


async def run_group(
    client: SessionClient,
    tasks: Sequence[Task],
    *,
    first_index: int = 0,
    config: AgentConfig | None = None,
    http_client: openai.DefaultAsyncHttpxClient | None = None,
    forks: bool = True,
) -> list[EpisodeResult]:
    """A GRPO group: the episodes of `tasks` (one prompt: the same messages and tools) run together, indexed from
    `first_index`. With `forks` the group starts as one session primed with the prompt and forked into len(tasks)
    (`SessionClient.group`): the prompt is rendered and tokenized once, and every child's first turn sends its ids
    without a render; without, each episode opens its own session. Never raises except on cancellation; a group
    that cannot be forked gives every episode that error."""
    config = config or AgentConfig()
    sessions: list[str | None] = [None] * len(tasks)
    if forks and tasks:
        first = tasks[0]
        if any(t.messages != first.messages or t.toolbox.specs != first.toolbox.specs for t in tasks[1:]):
            raise ValueError("a forked group's tasks share their prompt: the same messages and tools")
        try:
            sessions = list(await client.group(len(tasks), first.messages, first.toolbox.specs or None,
                                               metadata={**first.metadata, "group_first_episode": first_index}))
        except Exception as exc:
            return [EpisodeResult(index=first_index + i, messages=[dict(m) for m in t.messages],
                                  error=f"{type(exc).__name__}: {exc}", exception=exc) for i, t in enumerate(tasks)]
    return list(await asyncio.gather(*(
        run_episode(client, task, index=first_index + i, config=config, http_client=http_client, session_id=sid)
        for i, (task, sid) in enumerate(zip(tasks, sessions, strict=True)))))


async def _tool_loop(agent: openai.AsyncOpenAI, task: Task, config: AgentConfig, result: EpisodeResult) -> None:
    messages = result.messages
    tools = task.toolbox.specs
    while True:
        if result.turns >= task.max_turns:
            result.stop_reason = "turn_limit"
            return
        completion = await _complete(agent, messages, tools, config, result)
        result.turns += 1
        choice = completion.choices[0]
        reply = choice.message
        messages.append(reply.model_dump(exclude_none=True))
        if choice.finish_reason == "length":
            result.stop_reason = "length"
            return
        if not reply.tool_calls:
            result.final_answer = reply.content
            result.stop_reason = "final_answer"
            return
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in reply.tool_calls]
        outputs = await task.toolbox.run(calls)
        result.tool_calls += len(calls)
        messages.extend(
            {"role": "tool", "tool_call_id": call.id, "content": output}
            for call, output in zip(calls, outputs, strict=True)
        )


async def _complete(
    agent: openai.AsyncOpenAI,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    config: AgentConfig,
    result: EpisodeResult,
) -> Any:
    """One chat completion; a 503 is retried after its Retry-After (capped), at most `busy_retries` times."""
    kwargs: dict[str, Any] = {"model": config.model, "messages": messages}
    if tools:
        kwargs["tools"] = tools
    if config.temperature is not None:
        kwargs["temperature"] = config.temperature
    if config.max_tokens is not None:
        kwargs["max_tokens"] = config.max_tokens
    if config.extra_body:
        kwargs["extra_body"] = config.extra_body
    for attempt in range(config.busy_retries + 1):
        try:
            return await agent.chat.completions.create(**kwargs)
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or attempt == config.busy_retries:
                raise
            delay = parse_retry_after(exc.response.headers.get("retry-after"))
            result.busy_retries += 1
            await asyncio.sleep(min(config.default_retry_after if delay is None else delay, config.max_retry_after))
    raise AssertionError("unreachable")


async def iter_episodes(
    client: SessionClient,
    tasks: Iterable[Task],
    *,
    concurrency: int = 16,
    config: AgentConfig | None = None,
    fork_groups: int = 0,
) -> AsyncIterator[EpisodeResult]:
    """Run the tasks with at most `concurrency` episodes in flight; yield each result as it finishes.

    Tasks are pulled lazily, so `tasks` may be an endless generator. Closing the iterator early cancels the
    running episodes (each still deletes its session).

    `fork_groups` G > 0: every G consecutive tasks are one GRPO group (one prompt) run as forks of one primed session
    (`run_group`); concurrency // G groups run at once (at least one), and a group's results come when it ends.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if fork_groups < 0:
        raise ValueError("fork_groups must be >= 0")
    config = config or AgentConfig()
    size = max(1, fork_groups)
    pending = _chunks(enumerate(tasks), size)
    done: asyncio.Queue[EpisodeResult | None] = asyncio.Queue()
    http_client = openai.DefaultAsyncHttpxClient(timeout=config.request_timeout)

    async def worker() -> None:
        try:
            for chunk in pending:  # one shared iterator: each task goes to exactly one worker
                if fork_groups:
                    results = await run_group(client, [t for _, t in chunk], first_index=chunk[0][0], config=config,
                                              http_client=http_client)
                else:
                    (index, task), = chunk
                    results = [await run_episode(client, task, index=index, config=config, http_client=http_client)]
                for result in results:
                    done.put_nowait(result)
        finally:
            done.put_nowait(None)

    workers = [asyncio.create_task(worker()) for _ in range(max(1, concurrency // size))]
    try:
        running = len(workers)
        while running:
            item = await done.get()
            if item is None:
                running -= 1
            else:
                yield item
        for w in workers:
            w.result()  # surface a worker's unexpected failure (e.g. the task iterable raised)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await http_client.aclose()


def _chunks(items: Iterator[T], size: int) -> Iterator[list[T]]:
    """`items` `size` at a time (the last chunk may be shorter), pulled lazily."""
    while chunk := list(itertools.islice(items, size)):
        yield chunk


async def run_episodes(
    client: SessionClient,
    tasks: Iterable[Task],
    *,
    concurrency: int = 16,
    config: AgentConfig | None = None,
    on_result: Callable[[EpisodeResult], None] | None = None,
    fork_groups: int = 0,
) -> list[EpisodeResult]:
    """Run every task and return the results in task order; `on_result` sees each one as it finishes.
    `fork_groups` G: every G consecutive tasks are a GRPO group run as forks of one primed session (iter_episodes)."""
    results: list[EpisodeResult] = []
    async for result in iter_episodes(client, tasks, concurrency=concurrency, config=config,
                                      fork_groups=fork_groups):
        results.append(result)
        if on_result is not None:
            on_result(result)
    return sorted(results, key=lambda r: r.index)
