"""Three steps of `make demo-rl`'s GRPO loop (examples/demo_rl/) against real SGLang: each step's episodes run
through the session server, the trainer checks every sampled token against the weights of its version
(rollout.logprob_check), takes its clipped policy-gradient step and pushes the weights in place (rollout.weight_push);
the engine then serves exactly the trainer's weights under the next version.

The module runs its own engine, launched as the demo launches it (examples.demo_rl.engine.start_demo_engine): `--dtype
float32`, where the tier's shared engines serve the fp32 checkpoints in SGLang's "auto" dtype, float16, whose logprobs
differ from an fp32 recomputation by up to ~1e-2 once the weights are trained. The reward here is deliberately arbitrary
(the first episode of each group wins): whatever text a barely warmed-up policy samples, every group then has advantages
of both signs and the step must move the weights; whether the loop learns is the demo's question. The run is synchronous
(`overlap=False`: a step's episodes start after the previous push), so no reply straddles an update and every token is
recomputed exactly.
"""

from __future__ import annotations

import asyncio
import copy
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
from examples.demo_rl.policy import load_policy
from examples.demo_rl.warmup import warm_up
from harness.launchers import start_session_server
from rollout.episodes import EpisodeResult


@dataclass
class Stack:
    engine: str
    server: str
    checkpoint: Path


@pytest.fixture(scope="module")
def stack(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    python = pytestconfig.getoption("--sglang-venv").resolve() / "bin" / "python"
    checkpoint = pytestconfig.getoption("--checkpoints").resolve() / "qwen3-dense"
    logs = tmp_path_factory.mktemp("grpo-loop")
    engine = start_demo_engine(python, checkpoint, name="sglang[grpo]", log_path=logs / "sglang.log")
    try:
        with start_session_server(engine.url, checkpoint, "qwen3", log_dir=logs) as server:
            yield Stack(engine.url, server.url, checkpoint)
    finally:
        engine.stop()


def first_of_group_wins(prompt: Prompt, result: EpisodeResult, index: int) -> float:
    return 1.0 if index == 0 else 0.0


def engine_log_probs(engine: str, ids: list[int]) -> np.ndarray:
    """The engine's logprob of every token of `ids` after the first (a prefill; nothing generated counts)."""
    r = httpx.post(f"{engine}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True,
        "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    return np.array([lp for lp, _, _ in r.json()["meta_info"]["input_token_logprobs"][1:]], dtype=np.float64)


def trainer_log_probs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def test_three_steps_push_the_trainers_weights_into_the_engine(stack: Stack, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    game = WeatherGame(AutoTokenizer.from_pretrained(stack.checkpoint))
    policy = load_policy(stack.checkpoint, game, seed=0)
    warm_up(policy, game, steps=20, batch=8, lr=3e-3, p_call=0.5, rng=random.Random(0), progress=False)
    start = copy.deepcopy(policy.model)
    probe, _ = game.demonstration(Prompt("snow"), random.Random(0), 1.0)

    config = RunConfig(steps=3, groups_per_step=2, group_size=4, overlap=False, max_tokens=24, lr=1e-3, seed=1)
    result = asyncio.run(train_loop(config, game, policy, engine_url=stack.engine, server_url=stack.server,
                                    weights_dir=tmp_path, reward=first_of_group_wins, progress=False))

    assert result.versions == ["0", "1", "2", "3"]  # the engine's version after the first push and each step's
    for record in result.records:
        assert record.failed_episodes == 0 and record.episodes == 8, record.errors
        assert record.dropped_groups == 0 and record.kept_groups == 2
        assert record.tokens_by_staleness and set(record.tokens_by_staleness) == {0}  # nothing ran across a push
        assert record.check_ok, "\n".join(record.worst)  # every sampled token within 1e-3 of its version's weights
        assert record.straddled_tokens == 0
    served_now = engine_log_probs(stack.engine, probe)
    np.testing.assert_allclose(served_now, trainer_log_probs(policy.model, probe), atol=1e-3, rtol=0)
    moved = np.abs(served_now - trainer_log_probs(start, probe)).max()
    assert moved > 1e-2, f"the probe's logprobs moved by {moved} only"
