"""`make demo-rl`: a real GRPO loop on the CPU, end to end, against released SGLang 0.5.23.

What runs, in one process plus two children (the engine from its own venv, the session server):

1. a policy that can learn in minutes: the tiny random Qwen3 checkpoint (`make test-sglang` builds it), its tied
   embedding cut down to the task's alphabet (every other row exactly 0, so every other token has logit exactly 0:
   the full softmax over the 151k vocabulary stays exact and cheap, rollout.grpo.sampled_log_probs), warmed up with a
   few hundred plain-torch supervised steps on the task while the engine starts;
2. the task, multi-turn with a tool and a verifiable reward (`WeatherGame`): the user asks what to wear; the model
   may call `weather` (a tool the policy learned in its warm-up: it is not declared in the prompt, which keeps
   prompts short), reads today's weather (drawn per prompt: sun, rain, snow or cloud) and answers with one word; the
   reward is 1 when the word is the item for that weather (hat, coat, ski, shirt), 0 otherwise. The warm-up teaches
   the format, the call and the mapping, and shows both ways to answer, calling first in only 10% of its
   demonstrations of the choice: the starting policy mostly guesses (right one time in four) and earns ~0.3, and
   what RL finds is that looking the weather up pays;
3. G episodes per prompt through the session server, with the official `openai` client against each session's URL
   (rollout.episodes), running ahead of the trainer (`--ahead-groups` beyond a step's): the next step's episodes run
   while the trainer trains, and when it pushes its weights (rollout.weight_push: `/admin/pause` in_place, SGLang's
   `/update_weights_from_disk` with a `weight_version` and no abort, `/admin/continue`) the replies in flight go on
   under the new weights (partial rollouts) and no turn is lost;
4. every step the trainer checks the samples (rollout.logprob_check: each sampled token recomputed with the weights
   of the version that sampled it), bounds staleness at collection (`--max-staleness`: a group with a token sampled
   more than that many versions ago is dropped, and counted), computes group-relative advantages and takes clipped
   policy-gradient steps with truncated importance sampling against the rollout logprobs (rollout.grpo) on the
   alphabet's rows (the layers stay as the warm-up left them: `--body-lr`);
5. a progress bar per step; at the end a table, `metrics.json` and a PNG (reward and tool calls, mismatch and
   staleness per step).

The engine runs without its radix cache: a prefix cached under old weights would be reused under new ones (SGLang
flushes the cache on an update only when nothing runs, and here something always runs), and every token sampled on
that stale KV would differ from what the trainer recomputes. Tokens a reply samples after an update on KV its
earlier tokens computed under the old weights (the straddling replies of partial rollouts) are counted apart.

    python -m examples.demo_rl --sglang-venv .venv-sglang --checkpoints .cache/checkpoints
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import math
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openai
import torch

from harness.launchers import RunningProcess, start_session_server, start_sglang
from rollout.client import SessionClient
from rollout.episodes import AgentConfig, EpisodeResult, Task, run_episode
from rollout.grpo import clipped_pg_loss, filter_stale, group_advantages, sampled_log_probs, truncated_is_weights
from rollout.logprob_check import check_logprobs
from rollout.tools import Tool, Toolbox
from rollout.torch_batch import to_torch_batch
from rollout.weight_push import WeightPusher, save_weights
from trajectory import Sample

ROOT = Path(__file__).resolve().parent.parent
# SGLang's CPU path imports a CUDA-only op at load time: the real-engine tier's plugin supplies a pure-torch one
# (tests/sglang/plugin, registered through SGLang's own `sglang.srt.plugins` entry point).
PLUGIN_DIR = ROOT / "tests" / "sglang" / "plugin"
# `--dtype float32`: SGLang's "auto" serves a float32 checkpoint in float16 (weights and KV cache), and the trainer's
# fp32 recomputation then differs by ~1e-2 on a trained model's tokens.
# `--disable-overlap-schedule`: with the overlap scheduler a token's results are processed a batch after it was
# computed, so the token at an update's boundary can be recorded under the other version.
ENGINE_ARGS = ("--dtype", "float32", "--disable-radix-cache", "--disable-overlap-schedule",
               "--max-running-requests", "16", "--reasoning-parser", "qwen3")
# The weather the tool reports -> the one item the user should take for it (each word a single Qwen3 token).
ITEMS = {"sun": "hat", "rain": "coat", "snow": "ski", "cloud": "shirt"}
QUESTION = "wear?"
TEMPERATURE = 1.0
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


# -- the task ----------------------------------------------------------------------------------------------------------

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


# -- the policy --------------------------------------------------------------------------------------------------------

class AlphabetPolicy:
    """A transformers causal LM with tied embeddings, trained on a restricted alphabet only.

    Every embedding row outside the alphabet is set to exactly 0 and frozen, so those tokens embed to zero and have
    logit exactly 0 (the engine serving the saved weights computes the same); the alphabet's rows train as a small
    separate parameter, written back into the model (`sync`) before it is checked or saved."""

    def __init__(self, model: torch.nn.Module, alphabet: Sequence[int]) -> None:
        if not getattr(model.config, "tie_word_embeddings", False):
            raise ValueError("the alphabet policy needs tied embeddings")
        self.model = model
        self.alphabet = torch.tensor(sorted(alphabet), dtype=torch.long)
        weight = model.get_input_embeddings().weight
        weight.requires_grad_(False)
        with torch.no_grad():
            keep = torch.zeros(weight.shape[0], dtype=torch.bool)
            keep[self.alphabet] = True
            weight[~keep] = 0.0
        self.rows = torch.nn.Parameter(weight[self.alphabet].clone())

    def body_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters besides the alphabet's rows (the transformer's layers and final norm)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.body_parameters(), self.rows]

    def sync(self) -> None:
        with torch.no_grad():
            self.model.get_input_embeddings().weight[self.alphabet] = self.rows

    def log_probs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return sampled_log_probs(self.model, input_ids, loss_mask, attention_mask, temperature=TEMPERATURE,
                                 alphabet=self.alphabet, alphabet_rows=self.rows)

    def in_alphabet(self, tokens: np.ndarray) -> bool:
        return bool(np.isin(tokens, self.alphabet.numpy()).all())


def load_policy(checkpoint: Path, game: WeatherGame, seed: int) -> AlphabetPolicy:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return AlphabetPolicy(model, game.alphabet())


def warm_up(policy: AlphabetPolicy, game: WeatherGame, *, steps: int, batch: int, lr: float, p_call: float,
            rng: random.Random, progress: bool = True) -> list[float]:
    """Plain supervised steps on the game's demonstrations (the loss on the model's own turns only)."""
    from tqdm import tqdm

    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    losses: list[float] = []
    policy.model.train()
    for _ in tqdm(range(steps), desc="warm-up", unit="step", dynamic_ncols=True, disable=not progress):
        seqs = [game.demonstration(game.prompt(rng), rng, p_call) for _ in range(batch)]
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width)
        for row, (tokens, m) in enumerate(seqs):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(m)] = torch.tensor(m, dtype=torch.float32)
        logp = policy.log_probs(ids, mask)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    policy.sync()
    policy.model.eval()
    return losses


# -- rollouts ----------------------------------------------------------------------------------------------------------

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
                 ahead_groups: int, rng: random.Random) -> None:
        self.client, self.game, self.config = client, game, config
        self.group_size = group_size
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
        results = await asyncio.gather(*(
            run_episode(self.client, self.game.task(prompt), index=index * self.group_size + g, config=self.config,
                        http_client=self._http) for g in range(self.group_size)))
        self._done.put_nowait(Group(prompt, list(results), version))

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


# -- one training step -------------------------------------------------------------------------------------------------

@dataclass
class StepRecord:
    step: int
    version: int                    # the weights the step trained from (the next push is version + 1)
    reward_mean: float
    lookup_rate: float              # the fraction of episodes that called the tool
    episodes: int
    failed_episodes: int
    kept_groups: int
    dropped_groups: int
    tokens_by_staleness: dict[int, int]
    check_ok: bool                  # the check over every sampled token: within 1e-3
    mismatch_max: float             # the check's worst |engine - trainer| logprob over every sampled token
    mismatch_mean: float
    mismatch_max_clean: float       # over tokens whose reply ran on one version only
    mismatch_max_straddled: float   # over tokens sampled after an update, on KV of the older weights (nan: none)
    straddled_tokens: int
    k3_kl: float
    train_rollout_logprob_abs_diff: float
    pg_clipfrac: float
    is_weight_mean: float
    push_seconds: float
    seconds: float
    worst: list[str] = field(default_factory=list)


def straddled_mask(sample: Sample) -> np.ndarray:
    """Sampled tokens of a reply that started under older weights than theirs: each turn's completion is one engine
    request (continued requests aside) whose KV its first version computed."""
    out = np.zeros(len(sample.tokens), dtype=bool)
    spans = sample.metadata.get("weight_version_spans") or []
    for prompt_len, completion_len in sample.metadata.get("turns", []):
        end = prompt_len + completion_len
        first: str | None = None
        for version, a, b in spans:
            if b <= prompt_len or a >= end:
                continue
            if first is None:
                first = version
            elif version != first:
                out[max(a, prompt_len):min(b, end)] = True
    return out & sample.loss_mask.astype(bool)


class Trainer:
    """The policy, its optimizer, the weights of the versions samples may still carry, and the push."""

    def __init__(self, policy: AlphabetPolicy, *, lr: float, body_lr: float, clip: float, is_cap: float,
                 minibatches: int, max_staleness: int, weights_dir: Path, pusher: WeightPusher, reward: Reward,
                 flush_cache: bool = False) -> None:
        self.policy = policy
        self.reward = reward
        self.flush_cache = flush_cache
        # RL trains the alphabet's rows (`lr`) and the layers at `body_lr`, by default not at all: the rows carry the
        # choices the reward is about (to call or to answer straight away, which item), while the layers moving at
        # 1e-4 and up let the reply's first token turn into the call's second (a newline) within one step in some
        # runs of the offline prototype, after which every episode fails and no group has an advantage left.
        groups: list[dict[str, Any]] = [{"params": [policy.rows], "lr": lr}]
        if body_lr > 0:
            groups.append({"params": policy.body_parameters(), "lr": body_lr})
        else:
            for p in policy.body_parameters():
                p.requires_grad_(False)
        self.optimizer = torch.optim.Adam(groups)
        self.clip, self.is_cap, self.minibatches = clip, is_cap, minibatches
        self.max_staleness = max_staleness
        self.weights_dir = weights_dir
        self.pusher = pusher
        self.version = 0
        self.kept: dict[int, torch.nn.Module] = {0: copy.deepcopy(policy.model)}

    def model_of(self, version: Any) -> torch.nn.Module:
        return self.kept[int(version)]

    async def push(self, version: int) -> float:
        path = save_weights(self.policy.model, self.weights_dir / f"v{version % 2}")
        result = await self.pusher.push(path, str(version), flush_cache=self.flush_cache)
        return result.seconds

    async def step(self, step: int, groups: list[Group]) -> StepRecord:
        started = time.perf_counter()
        current = self.version
        failed = sum(not r.ok for g in groups for r in g.results)
        healthy = [g for g in groups if all(r.ok and r.samples for r in g.results)]
        kept, staleness = filter_stale([[s for r in g.results for s in r.samples] for g in healthy], current,
                                       self.max_staleness)
        kept_ids = {id(samples[0]) for samples in kept}
        used = [g for g in healthy if id(g.results[0].samples[0]) in kept_ids]
        rewards = [x for g in groups for x in g.rewards(self.reward)]
        calls = [r.tool_calls > 0 for g in groups for r in g.results]
        record = StepRecord(step=step, version=current, reward_mean=float(np.mean(rewards)) if rewards else 0.0,
                            lookup_rate=float(np.mean(calls)) if calls else 0.0, episodes=len(rewards),
                            failed_episodes=failed, kept_groups=staleness.kept_groups,
                            dropped_groups=staleness.dropped_groups,
                            tokens_by_staleness=dict(sorted(staleness.tokens_by_staleness.items())), check_ok=True,
                            mismatch_max=0.0, mismatch_mean=0.0, mismatch_max_clean=0.0,
                            mismatch_max_straddled=math.nan, straddled_tokens=0, k3_kl=0.0,
                            train_rollout_logprob_abs_diff=0.0, pg_clipfrac=0.0, is_weight_mean=1.0,
                            push_seconds=0.0, seconds=0.0)
        if used:
            await asyncio.to_thread(self._train, record, used)
        else:  # nothing kept: nothing checked or trained this step
            record.mismatch_max = record.mismatch_mean = record.mismatch_max_clean = math.nan
        self.version = current + 1
        self.kept[self.version] = copy.deepcopy(self.policy.model)
        for old in [v for v in self.kept if v < self.version - self.max_staleness - 1]:
            del self.kept[old]
        record.push_seconds = await self.push(self.version)
        record.seconds = time.perf_counter() - started
        return record

    def _train(self, record: StepRecord, groups: list[Group]) -> None:
        episodes = [r.samples for g in groups for r in g.results]
        samples = [s for e in episodes for s in e]
        report = check_logprobs(samples, self.model_of, temperature=TEMPERATURE, worst=5)
        m = report.metrics
        record.check_ok = report.ok()
        record.mismatch_max = report.max_abs_diff
        record.mismatch_mean = m.get("rollout_check/logprob_abs_diff_mean", 0.0)
        record.k3_kl = m.get("rollout_corr/k3_kl", 0.0)
        record.train_rollout_logprob_abs_diff = m.get("train_rollout_logprob_abs_diff", 0.0)
        record.worst = report.format().splitlines()[1:]
        clean, straddled = [], []
        for sample, check in zip(samples, report.per_sample, strict=True):
            diff = np.abs(check.trainer_log_probs - sample.rollout_log_probs)
            cut = straddled_mask(sample)
            sampled = sample.loss_mask.astype(bool)
            sampled[0] = False
            clean.append(diff[sampled & ~cut])
            straddled.append(diff[cut])
        record.mismatch_max_clean = float(np.concatenate(clean).max(initial=0.0))
        joined = np.concatenate(straddled)
        record.straddled_tokens = int(joined.size)
        record.mismatch_max_straddled = float(joined.max()) if joined.size else math.nan

        rewards = [x for g in groups for x in g.rewards(self.reward)]
        group_of = [i for i, g in enumerate(groups) for _ in g.results]
        advantages = group_advantages(rewards, group_of)
        batch = to_torch_batch(episodes=episodes)
        adv = torch.from_numpy(advantages)[batch["episode_index"]]
        ids, mask, attention = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        with torch.no_grad():
            old = self.policy.log_probs(ids, mask, attention)
        weights = truncated_is_weights(old, batch["rollout_log_probs"], mask, self.is_cap)
        rows = torch.randperm(len(ids))
        metrics: list[dict[str, float]] = []
        self.policy.model.train()
        for part in rows.chunk(self.minibatches):
            logp = self.policy.log_probs(ids[part], mask[part], attention[part])
            out = clipped_pg_loss(logp, old[part], adv[part], mask[part], clip_low=self.clip, clip_high=self.clip,
                                  is_weights=weights[part])
            self.optimizer.zero_grad()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
            self.optimizer.step()
            metrics.append(out.metrics)
        self.policy.model.eval()
        self.policy.sync()
        record.pg_clipfrac = float(np.mean([x["pg_clipfrac"] for x in metrics]))
        record.is_weight_mean = float(np.mean([x.get("is_weight_mean", 1.0) for x in metrics]))


# -- the run -----------------------------------------------------------------------------------------------------------

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
    agent = AgentConfig(temperature=TEMPERATURE, max_tokens=config.max_tokens, extra_body=THINKING_OFF,
                        busy_retries=50, default_retry_after=0.2, max_retry_after=0.5, sample_format="safetensors")
    async with SessionClient(server_url) as client, WeightPusher(engine_url, [server_url]) as pusher:
        trainer = Trainer(policy, lr=config.lr, body_lr=config.body_lr, clip=config.clip, is_cap=config.is_cap,
                          minibatches=config.minibatches, max_staleness=config.max_staleness,
                          weights_dir=weights_dir, pusher=pusher, reward=reward, flush_cache=not config.overlap)
        await trainer.push(0)
        versions = [await pusher.engine_version()]
        ahead = config.ahead_groups if config.overlap else 0
        rollouts = Rollouts(client, game, agent, group_size=config.group_size,
                            ahead_groups=config.groups_per_step + ahead, rng=rng)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-venv", type=Path, default=ROOT / ".venv-sglang", help="the real engine's venv")
    p.add_argument("--checkpoints", type=Path, default=ROOT / ".cache" / "checkpoints",
                   help="the tiny checkpoints (scripts/build_tiny_checkpoints.py); qwen3-dense is the start")
    p.add_argument("--steps", type=int, default=RunConfig.steps)
    p.add_argument("--groups-per-step", type=int, default=RunConfig.groups_per_step, help="prompts per step")
    p.add_argument("--group-size", type=int, default=RunConfig.group_size, metavar="G", help="episodes per prompt")
    p.add_argument("--ahead-groups", type=int, default=RunConfig.ahead_groups,
                   help="groups kept running beyond the step being collected (default %(default)s)")
    p.add_argument("--max-staleness", type=int, default=RunConfig.max_staleness)
    p.add_argument("--lr", type=float, default=RunConfig.lr,
                   help="the RL learning rate of the alphabet's embedding rows (default %(default)s)")
    p.add_argument("--body-lr", type=float, default=RunConfig.body_lr,
                   help="the RL learning rate of the transformer's layers (default %(default)s: frozen)")
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--warmup-lr", type=float, default=3e-3)
    p.add_argument("--warmup-call", type=float, default=0.1,
                   help="how often the warm-up's demonstrations of the choice call the tool (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (default 1: the engine "
                   "and the session server need the other core)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "demo-rl")
    return p.parse_args(argv)


def _verdict(r: StepRecord) -> str:
    """"ok": every token within 1e-3; "ok*": every token of a reply on one version within it (the rest straddled an
    update); "FAIL" otherwise; "-" when nothing was kept."""
    if math.isnan(r.mismatch_max):
        return "-"
    if r.check_ok:
        return "ok"
    return "ok*" if r.mismatch_max_clean <= 1e-3 else "FAIL"


def table(records: list[StepRecord]) -> str:
    """One line per step: reward, lookups, episodes, groups kept/dropped, tokens by staleness, the check, the push."""
    head = (f"{'step':>4} {'ver':>3} {'reward':>6} {'lookup':>6} {'eps':>4} {'fail':>4} {'kept':>4} {'drop':>4} "
            f"{'stale0/1/2+':>13} {'check':>5} {'mismatch max':>12} {'clean':>9} {'straddled':>9} {'k3_kl':>8} "
            f"{'push s':>6} {'step s':>6}")
    lines = [head, "-" * len(head)]
    for r in records:
        t = r.tokens_by_staleness
        stale = f"{t.get(0, 0)}/{t.get(1, 0)}/{sum(v for k, v in t.items() if k >= 2)}"
        straddled = "-" if math.isnan(r.mismatch_max_straddled) else f"{r.mismatch_max_straddled:.2e}"
        lines.append(f"{r.step:>4} {r.version:>3} {r.reward_mean:>6.2f} {r.lookup_rate:>6.2f} {r.episodes:>4} "
                     f"{r.failed_episodes:>4} {r.kept_groups:>4} {r.dropped_groups:>4} {stale:>13} {_verdict(r):>5} "
                     f"{r.mismatch_max:>12.2e} {r.mismatch_max_clean:>9.2e} {straddled:>9} {r.k3_kl:>8.1e} "
                     f"{r.push_seconds:>6.2f} {r.seconds:>6.2f}")
    return "\n".join(lines)


def plot(records: list[StepRecord], path: Path, title: str) -> Path:
    """Three panels: reward per step, the logprob mismatch per step (log scale), sampled tokens by staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    steps = [r.step for r in records]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax1.plot(steps, [r.reward_mean for r in records], marker="o", label="mean reward")
    ax1.plot(steps, [r.lookup_rate for r in records], linestyle="--", marker=".", label="episodes that called the tool")
    ax1.set_ylabel("per episode")
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_ylim(-0.02, 1.02)
    ax1.set_title(title)
    ax1.grid(alpha=0.3)
    floor = 1e-9  # a step whose worst token agrees exactly still shows on a log axis
    ax2.semilogy(steps, [max(r.mismatch_max, floor) for r in records], marker="o", label="max |diff|, all tokens")
    ax2.semilogy(steps, [max(r.mismatch_max_clean, floor) for r in records], marker=".",
                 label="max |diff|, replies on one version")
    ax2.semilogy(steps, [max(r.mismatch_mean, floor) for r in records], marker=".", label="mean |diff|")
    straddled = [(r.step, r.mismatch_max_straddled) for r in records if not math.isnan(r.mismatch_max_straddled)]
    if straddled:
        ax2.semilogy([s for s, _ in straddled], [max(v, floor) for _, v in straddled], "x",
                     label="max |diff|, tokens after an update mid-reply")
    ax2.axhline(1e-3, color="grey", linestyle="--", linewidth=1, label="1e-3 (fp32 bar)")
    ax2.set_ylabel("engine vs trainer logprob")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax2.grid(alpha=0.3)
    bottom = np.zeros(len(records))
    for staleness, label in ((0, "staleness 0"), (1, "staleness 1"), (2, "staleness 2+")):
        counts = np.array([sum(v for k, v in r.tokens_by_staleness.items()
                               if (k == staleness if staleness < 2 else k >= 2)) for r in records], dtype=float)
        ax3.bar(steps, counts, bottom=bottom, label=label)
        bottom += counts
    ax3.set_ylabel("sampled tokens trained on")
    ax3.set_xlabel("step")
    ax3.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    dropped = [r.dropped_groups for r in records]
    if any(dropped):
        twin = ax3.twinx()
        twin.plot(steps, dropped, "k.", label="groups dropped (too stale)")
        twin.set_ylabel("groups dropped")
        twin.legend(loc="upper right", fontsize=7)
    ax3.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so the engine and the session server are stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    torch.set_num_threads(args.threads)
    python = args.sglang_venv.resolve() / "bin" / "python"
    checkpoint = (args.checkpoints / "qwen3-dense").resolve()
    if not python.exists() or not (checkpoint / "config.json").exists():
        print(f"error: need {python} and {checkpoint}: `make demo-rl` builds both (as `make test-sglang` does)",
              file=sys.stderr)
        return 2
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    started = time.perf_counter()
    out: Path = args.out
    logs = out / "logs"
    config = RunConfig(steps=args.steps, groups_per_step=args.groups_per_step, group_size=args.group_size,
                       ahead_groups=args.ahead_groups, max_staleness=args.max_staleness, lr=args.lr,
                       body_lr=args.body_lr, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    game = WeatherGame(tokenizer)
    # The engine starts (30-60 s of mostly its own imports) while the policy warms up.
    # One torch thread in the engine: a 2-layer model gains nothing from more, and spinning OpenMP threads starve
    # the trainer and the session server on a 2-core machine.
    engine = start_sglang(python, checkpoint, *ENGINE_ARGS, plugin_dir=PLUGIN_DIR, name="sglang", wait=False,
                          log_path=logs / "sglang.log", env={"OMP_NUM_THREADS": "1"})
    server: RunningProcess | None = None
    try:
        policy = load_policy(checkpoint, game, args.seed)
        warm = time.perf_counter()
        losses = warm_up(policy, game, steps=args.warmup_steps, batch=16, lr=args.warmup_lr,
                         p_call=args.warmup_call, rng=random.Random(args.seed))
        warm_seconds = time.perf_counter() - warm
        print(f"warm-up: {args.warmup_steps} steps in {warm_seconds:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.3f}")
        engine.wait_ready()
        print(f"engine ready after {time.perf_counter() - started:.0f} s (logs in {logs})")
        server = start_session_server(engine.url, checkpoint, "qwen3", log_dir=logs)
        steps_log = out / "steps.jsonl"
        steps_log.unlink(missing_ok=True)
        result = asyncio.run(train_loop(config, game, policy, engine_url=engine.url, server_url=server.url,
                                        weights_dir=out / "weights", log=steps_log))
    finally:
        if server is not None:
            server.stop()
        engine.stop()
    wall = time.perf_counter() - started
    records = result.records
    print(table(records))
    first, last = records[0].reward_mean, float(np.mean([r.reward_mean for r in records[-3:]]))
    summary = {
        "wall_seconds": round(wall, 1), "warmup_seconds": round(warm_seconds, 1), "steps": len(records),
        "reward_first_step": first, "reward_last_3_steps": round(last, 3),
        "lookup_rate_first_step": records[0].lookup_rate,
        "lookup_rate_last_3_steps": round(float(np.mean([r.lookup_rate for r in records[-3:]])), 3),
        "episodes": sum(r.episodes for r in records), "failed_episodes": sum(r.failed_episodes for r in records),
        "dropped_groups": sum(r.dropped_groups for r in records),
        "tokens_by_staleness": {k: sum(r.tokens_by_staleness.get(k, 0) for r in records)
                                for k in sorted({k for r in records for k in r.tokens_by_staleness})},
        "straddled_tokens": sum(r.straddled_tokens for r in records),
        "steps_check_ok": sum(r.check_ok for r in records),
        "steps_check_ok_on_one_version_replies": sum(_verdict(r) in ("ok", "ok*") for r in records),
        "worst_clean_mismatch": float(np.nanmax([r.mismatch_max_clean for r in records])),
        "engine_versions": result.versions, "groups_cancelled_at_the_end": result.cancelled_groups,
    }
    png = plot(records, out / "demo_rl.png",
               f"GRPO on released SGLang 0.5.23 (CPU): {len(records)} steps, "
               f"{config.groups_per_step}x{config.group_size} episodes each, wall {wall:.0f} s")
    (out / "metrics.json").write_text(json.dumps({"summary": summary, "config": asdict(config),
                                                  "steps": [asdict(r) for r in records]}, indent=1) + "\n")
    width = max(map(len, summary))
    for key, value in summary.items():
        if key != "engine_versions":
            print(f"{key:<{width}}  {value}")
    print(f"plot: {png}\nmetrics: {out / 'metrics.json'}")
    return 0 if summary["failed_episodes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
