"""The run (`train_loop`): push the policy as version 0, then GRPO steps with the next episodes running while the
trainer trains; `RunConfig` holds its knobs."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from examples.demo_rl.game import THINKING_OFF, Reward, WeatherGame
from examples.demo_rl.lora import LoraConfig, LoraPolicy, LoraTrainer
from examples.demo_rl.policy import TEMPERATURE, AlphabetPolicy
from examples.demo_rl.rollouts import Rollouts
from examples.demo_rl.step_record import StepRecord
from examples.demo_rl.trainer import Trainer
from examples.demo_rl.truncation import Truncation
from rollout.client import SessionClient
from rollout.episodes import AgentConfig
from rollout.weight_push import WeightPusher


@dataclass
class RunConfig:
    steps: int = 20
    groups_per_step: int = 6
    group_size: int = 8
    ahead_groups: int = 2           # groups kept running beyond the step being collected
    max_staleness: int = 1
    lr: float = 2e-3                # the alphabet's embedding rows (input and output: they are tied)
    body_lr: float = 0.0            # the transformer's layers (0: frozen during RL)
    clip: float = 0.2
    is_cap: float = 2.0
    minibatches: int = 2
    max_tokens: int = 24
    seed: int = 0
    # False: the next step's episodes start only after the push, so none runs across it, and the push flushes the
    # engine's prefix cache (an engine serving with one: the real-engine tier's shared one).
    overlap: bool = True
    # True: each group starts as one session primed with the prompt and forked into G (--fork-groups, issue 39).
    fork_groups: bool = False
    # --top-k / --top-p: sampling masks and support-normalised ratios (truncation.py)
    truncation: Truncation = field(default_factory=Truncation)
    # --lora: a LoRA adapter on o_proj trains instead of the alphabet's rows, a revision pushed per step (lora.py)
    lora: LoraConfig | None = None


@dataclass
class RunResult:
    records: list[StepRecord]
    versions: list[str]             # the engine's weight version after each push
    cancelled_groups: int
    start_reward: float = 0.0


async def train_loop(config: RunConfig, game: WeatherGame, policy: AlphabetPolicy, *, engine_url: str,
                     server_url: str, weights_dir: Path, reward: Reward = WeatherGame.reward,
                     progress: bool = True, log: Path | None = None) -> RunResult:
    """Push the policy as version 0, then `config.steps` GRPO steps with episodes running ahead."""
    from tqdm import tqdm

    rng = random.Random(config.seed)
    agent = AgentConfig(temperature=TEMPERATURE, max_tokens=config.max_tokens,
                        extra_body={**THINKING_OFF, **config.truncation.sampling()},
                        busy_retries=50, default_retry_after=0.2, max_retry_after=0.5, sample_format="safetensors")
    async with SessionClient(server_url) as client, WeightPusher(engine_url, [server_url]) as pusher:
        if isinstance(policy, LoraPolicy) != (config.lora is not None):
            raise ValueError("RunConfig.lora and a LoraPolicy go together")
        common: dict[str, Any] = dict(clip=config.clip, is_cap=config.is_cap, minibatches=config.minibatches,
                                      max_staleness=config.max_staleness, weights_dir=weights_dir, pusher=pusher,
                                      reward=reward, flush_cache=not config.overlap,
                                      support=config.truncation.on)
        trainer = (LoraTrainer(policy, lr=config.lora.lr, **common)
                   if isinstance(policy, LoraPolicy) and config.lora is not None
                   else Trainer(policy, lr=config.lr, body_lr=config.body_lr, **common))
        await trainer.push(0)
        versions = [await pusher.engine_version()]
        ahead = config.ahead_groups if config.overlap else 0
        rollouts = Rollouts(client, game, agent, group_size=config.group_size,
                            ahead_groups=config.groups_per_step + ahead, rng=rng, fork_groups=config.fork_groups)
        rollouts.start()
        records: list[StepRecord] = []
        try:
            with tqdm(total=config.steps, desc="GRPO", unit="step", dynamic_ncols=True, disable=not progress) as bar:
                for step in range(config.steps):
                    groups = await rollouts.take(config.groups_per_step, release=config.overlap)
                    record = await trainer.step(step, groups)
                    rollouts.version = trainer.version
                    if not config.overlap:
                        rollouts.release(config.groups_per_step)
                    versions.append(await pusher.engine_version())
                    records.append(record)
                    if log is not None:
                        with log.open("a") as f:
                            f.write(json.dumps(asdict(record)) + "\n")
                    bar.set_postfix(reward=f"{record.reward_mean:.2f}", lookup=f"{record.lookup_rate:.2f}",
                                    mismatch=f"{record.mismatch_max:.1e}", dropped=record.dropped_groups,
                                    refresh=False)
                    bar.update()
        finally:
            cancelled = await rollouts.stop()
    return RunResult(records, versions, cancelled)
