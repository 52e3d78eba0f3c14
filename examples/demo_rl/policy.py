"""The policy (`AlphabetPolicy`): a tiny transformers model trained on the game's alphabet only, so that the full
softmax over the 151k vocabulary stays exact and cheap for the trainer and the engine alike."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from examples.demo_rl.game import WeatherGame
from rollout.grpo import sampled_log_probs

# The sampling temperature of the episodes, and so of every recomputed logprob.
TEMPERATURE = 1.0


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
                  attention_mask: torch.Tensor | None = None,
                  sampling_masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Each sampled token's logprob; with `sampling_masks`, renormalised over its row (truncation.py)."""
        return sampled_log_probs(self.model, input_ids, loss_mask, attention_mask, temperature=TEMPERATURE,
                                 alphabet=self.alphabet, alphabet_rows=self.rows, sampling_masks=sampling_masks)

    def in_alphabet(self, tokens: np.ndarray) -> bool:
        return bool(np.isin(tokens, self.alphabet.numpy()).all())


def load_policy(checkpoint: Path, game: WeatherGame, seed: int) -> AlphabetPolicy:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return AlphabetPolicy(model, game.alphabet())
