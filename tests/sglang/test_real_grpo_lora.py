"""`make demo-rl`'s `--lora` (examples/demo_rl/lora.py) against real SGLang: three GRPO steps train a LoRA adapter on
o_proj, each pushed as a new revision (`/load_lora_adapter`) with each turn on the newest one; every sampled token is
checked against the base plus the revision that sampled it, and the engine then serves exactly the trainer's adapter.

Its own engine, launched as the demo launches it with `--lora` (start_demo_engine, LoRA flags). The reward
is arbitrary (the first episode of each group wins), as in test_real_grpo_loop.py: every group has advantages of both
signs, so every step must move the adapter. Synchronous (`overlap=False`): every token is its step's revision's.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from examples.demo_rl.engine import start_demo_engine
from examples.demo_rl.game import Prompt, WeatherGame
from examples.demo_rl.loop import RunConfig, train_loop
from examples.demo_rl.lora import ADAPTER, LoraConfig, LoraPolicy, LoraWeights
from examples.demo_rl.policy import load_policy
from examples.demo_rl.warmup import warm_up
from harness.launchers import start_session_server
from rollout.episodes import EpisodeResult

LORA = LoraConfig(rank=4, alpha=8.0, lr=5e-2)


@dataclass
class Stack:
    engine: str
    server: str
    checkpoint: Path
    weights: LoraWeights
    weights_dir: Path


@pytest.fixture(scope="module")
def stack(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    python = pytestconfig.getoption("--sglang-venv").resolve() / "bin" / "python"
    checkpoint = pytestconfig.getoption("--checkpoints").resolve() / "qwen3-dense"
    logs = tmp_path_factory.mktemp("grpo-lora")
    weights_dir = logs / "weights"
    weights = LoraWeights(LORA, checkpoint, seed=0)
    first = weights.save(weights_dir / "adapter" / "r0")  # where the trainer saves revision 0 too
    engine = start_demo_engine(python, checkpoint, *LORA.engine_args(first), name="sglang[grpo-lora]",
                               log_path=logs / "sglang.log")
    try:
        with start_session_server(engine.url, checkpoint, "qwen3", *LORA.server_args(), log_dir=logs) as server:
            yield Stack(engine.url, server.url, checkpoint, weights, weights_dir)
    finally:
        engine.stop()


def first_of_group_wins(prompt: Prompt, result: EpisodeResult, index: int) -> float:
    return 1.0 if index == 0 else 0.0


def engine_log_probs(engine: str, ids: list[int], adapter: str) -> np.ndarray:
    """The engine's logprob of every token of `ids` after the first, served with LoRA adapter `adapter`."""
    r = httpx.post(f"{engine}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True,
        "logprob_start_len": 0, "lora_path": adapter})
    assert r.status_code == 200, r.text
    return np.array([lp for lp, _, _ in r.json()["meta_info"]["input_token_logprobs"][1:]], dtype=np.float64)


def test_three_steps_push_three_adapter_revisions(stack: Stack) -> None:
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    game = WeatherGame(AutoTokenizer.from_pretrained(stack.checkpoint))
    warmed = load_policy(stack.checkpoint, game, seed=0)
    warm_up(warmed, game, steps=20, batch=8, lr=3e-3, p_call=0.5, rng=random.Random(0), progress=False)
    policy = LoraPolicy(warmed, stack.weights)
    probe, _ = game.demonstration(Prompt("snow"), random.Random(0), 1.0)
    ids, mask = torch.tensor([probe]), torch.ones(1, len(probe))

    config = RunConfig(steps=3, groups_per_step=2, group_size=4, overlap=False, max_tokens=24, seed=1, lora=LORA)
    result = asyncio.run(train_loop(config, game, policy, engine_url=stack.engine, server_url=stack.server,
                                    weights_dir=stack.weights_dir, reward=first_of_group_wins, progress=False))

    assert result.versions == ["0"] * 4  # the base is pushed once; the adapter moves
    for record in result.records:
        assert record.failed_episodes == 0 and record.episodes == 8
        assert record.dropped_groups == 0 and record.kept_groups == 2
        assert record.tokens_by_staleness and set(record.tokens_by_staleness) == {0}  # sampled by its revision
        assert record.episodes_across_revisions == 0  # synchronous: no push while an episode runs
        assert record.check_ok, "\n".join(record.worst)  # base + the token's revision, within 1e-3
    with torch.no_grad():
        trained = policy.log_probs(ids, mask)[0, 1:].double().numpy()
        base = super(LoraPolicy, policy).log_probs(ids, mask)[0, 1:].double().numpy()
    served = engine_log_probs(stack.engine, probe, f"{ADAPTER}@3")
    np.testing.assert_allclose(served, trained, atol=1e-3, rtol=0)
    moved = np.abs(served - base).max()
    assert moved > 1e-2, f"the probe's logprobs moved by {moved} only"
