"""The warm-up: plain supervised steps on the game's demonstrations while the engine starts, so that RL begins from
a policy that knows the format, the call and the mapping, and mostly guesses."""

from __future__ import annotations

import random

import torch

from examples.demo_rl.game import WeatherGame
from examples.demo_rl.policy import AlphabetPolicy


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
