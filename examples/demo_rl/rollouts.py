"""The rollouts: G-episode groups through the session server, kept running ahead of the trainer (partial rollouts:
episodes in flight go on across a weight push)."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

import openai

from examples.demo_rl.game import Prompt, Reward, WeatherGame
from rollout.client import SessionClient
from rollout.episodes import AgentConfig, EpisodeResult, run_group


@dataclass
class Group:
    """One prompt's G episodes, launched together under `launched_at` (the trainer's version at launch)."""

    prompt: Prompt
    results: list[EpisodeResult]
    launched_at: int

    def rewards(self, reward: Reward) -> list[float]:
        return [reward(self.prompt, r, g) for g, r in enumerate(self.results)]


class Rollouts:
    """Keeps G-episode groups running ahead of the trainer: at most `ahead_groups` launched and not yet taken."""

    def __init__(self, client: SessionClient, game: WeatherGame, config: AgentConfig, *, group_size: int,
                 ahead_groups: int, rng: random.Random, fork_groups: bool = False) -> None:
        self.client, self.game, self.config = client, game, config
        self.group_size = group_size
        self.fork_groups = fork_groups  # a group starts as one primed session forked into G (rollout.run_group)
        self.rng = rng
        self.version = 0
        self._slots = asyncio.Semaphore(ahead_groups)
        self._done: asyncio.Queue[Group] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._http = openai.DefaultAsyncHttpxClient(timeout=config.request_timeout)
        self._launcher: asyncio.Task[None] | None = None
        self.launched = 0

    def start(self) -> None:
        self._launcher = asyncio.create_task(self._launch_forever())

    async def _launch_forever(self) -> None:
        while True:
            await self._slots.acquire()
            prompt = self.game.prompt(self.rng)
            task = asyncio.create_task(self._group(prompt, self.version))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _group(self, prompt: Prompt, version: int) -> None:
        index = self.launched
        self.launched += 1
        tasks = [self.game.task(prompt) for _ in range(self.group_size)]
        results = await run_group(self.client, tasks, first_index=index * self.group_size, config=self.config,
                                  http_client=self._http, forks=self.fork_groups)
        self._done.put_nowait(Group(prompt, results, version))

    async def take(self, groups: int, *, release: bool = True) -> list[Group]:
        """The next `groups` groups to finish (in the order they finished); their slots go to new groups at once,
        or with `release=False` when the caller calls `release` (after its weight push: nothing then runs across
        it)."""
        out = []
        for _ in range(groups):
            out.append(await self._done.get())
            if release:
                self._slots.release()
        return out

    def release(self, groups: int) -> None:
        for _ in range(groups):
            self._slots.release()

    async def stop(self) -> int:
        """Cancel what still runs (each episode deletes its session; the session server is stopped next, so a
        delete it fails to answer is not worth a logged traceback); returns the groups cancelled unfinished."""
        unfinished = len(self._tasks)
        tasks = [t for t in (self._launcher, *self._tasks) if t is not None]
        client_log = logging.getLogger("rollout.client")
        level = client_log.level
        client_log.setLevel(logging.CRITICAL)
        try:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            client_log.setLevel(level)
        await self._http.aclose()
        return unfinished
