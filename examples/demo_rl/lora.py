"""`--lora`: RL trains a rank-r LoRA adapter on the attention's q/v projections instead of the alphabet's rows.

The base weights stay as the warm-up left them (pushed once, as weight version 0); each step saves the adapter in
PEFT's format (the two files SGLang's `/load_lora_adapter` and rollout/lora_merge.py read) and pushes it as the next
revision of one adapter (`WeightPusher.push_adapter`, no pause: loading under a new name touches no running request).
The session server is started with `--lora-adapter NAME`, so every session is pinned to the revision newest at its
start; the check scores each token with the base plus the revision that sampled it, and staleness is counted in
revisions. PEFT is not installed: the low-rank deltas are added by forward hooks on the target projections, only while
the trainer computes logprobs, so the model itself (its copies, its saved weights) stays the base.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.demo_rl.policy import AlphabetPolicy
from examples.demo_rl.trainer import Trainer
from rollout.grpo import StalenessReport
from trajectory import Sample, sample_metadata
from trajectory.sample_metadata import AdapterRevision

ADAPTER = "policy"                  # the adapter's name in the engine (`--lora-paths policy=DIR`) and the server
TARGETS = ("q_proj", "v_proj")
PEFT_PREFIX = "base_model.model."   # rollout/lora_merge.py reads PEFT's tensor names


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 4
    alpha: float = 8.0
    lr: float = 1e-2
    max_loaded: int = 6             # the engine's --max-loaded-loras and --max-loras-per-batch

    def engine_args(self, first_revision: Path) -> tuple[str, ...]:
        """The engine's LoRA flags (docs/lora.md: torch_native on a CPU, the test plugin's pin_memory patch)."""
        return ("--enable-lora", "--lora-paths", f"{ADAPTER}={first_revision}", "--max-lora-rank", str(self.rank),
                "--lora-target-modules", *TARGETS, "--lora-backend", "torch_native",
                "--max-loaded-loras", str(self.max_loaded), "--max-loras-per-batch", str(self.max_loaded))

    @staticmethod
    def server_args() -> tuple[str, ...]:
        return ("--lora-adapter", ADAPTER)


class LoraWeights:
    """The adapter's A [r, in] and B [out, r] per target module, by module name (`model.layers.0.self_attn.q_proj`).

    A starts as PEFT's (uniform in +-1/sqrt(in)), B at zero: revision 0 is the base model exactly."""

    def __init__(self, config: LoraConfig, checkpoint: Path, seed: int) -> None:
        cfg = json.loads((checkpoint / "config.json").read_text())
        hidden, head_dim = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
        self.config = config
        self.scale = config.alpha / config.rank
        g = torch.Generator().manual_seed(seed)
        self.a: dict[str, torch.nn.Parameter] = {}
        self.b: dict[str, torch.nn.Parameter] = {}
        bound = 1 / math.sqrt(hidden)
        for layer in range(cfg["num_hidden_layers"]):
            for target in TARGETS:
                name = f"model.layers.{layer}.self_attn.{target}"
                self.a[name] = torch.nn.Parameter((torch.rand(config.rank, hidden, generator=g) * 2 - 1) * bound)
                self.b[name] = torch.nn.Parameter(torch.zeros(outs[target], config.rank))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.a.values(), *self.b.values()]

    def save(self, directory: Path) -> Path:
        """The adapter in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name in self.a:
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = self.a[name].detach().clone().contiguous()
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = self.b[name].detach().clone().contiguous()
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.config.rank, "lora_alpha": self.config.alpha,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "target_modules": list(TARGETS),
            "modules_to_save": None, "use_rslora": False, "use_dora": False, "inference_mode": True}, indent=2))
        return directory


class LoraPolicy(AlphabetPolicy):
    """The warmed-up policy with its model and rows frozen and a LoRA adapter as its only trainable parameters."""

    def __init__(self, policy: AlphabetPolicy, weights: LoraWeights) -> None:
        self.model, self.alphabet, self.rows = policy.model, policy.alphabet, policy.rows
        self.weights = weights
        self.rows.requires_grad_(False)
        for p in self.model.parameters():
            p.requires_grad_(False)
        modules = dict(self.model.named_modules())
        missing = [name for name in weights.a if name not in modules]
        if missing:
            raise ValueError(f"the model has no {missing[0]}")
        self.targets = {name: modules[name] for name in weights.a}

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.weights.parameters()

    @contextmanager
    def adapted(self) -> Iterator[None]:
        """The model's forward with `x @ A.T @ B.T * alpha / r` added to each target's output."""
        def hook(name: str) -> Any:
            a, b, scale = self.weights.a[name], self.weights.b[name], self.weights.scale

            def add_delta(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
                          ) -> torch.Tensor:
                return output + (inputs[0] @ a.T) @ b.T * scale
            return add_delta

        handles = [module.register_forward_hook(hook(name)) for name, module in self.targets.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def log_probs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  attention_mask: torch.Tensor | None = None,
                  sampling_masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        with self.adapted():
            return super().log_probs(input_ids, loss_mask, attention_mask, sampling_masks)


def adapter_staleness(sample: Sample, current: int) -> np.ndarray:
    """Per sampled token, how many revisions of the adapter behind `current` the revision that sampled it is."""
    meta = sample_metadata(sample)
    out = []
    for adapter, sampled in zip(meta.token_adapters, sample.loss_mask.astype(bool).tolist(), strict=False):
        if not sampled or adapter is None:
            continue
        if adapter.name != ADAPTER or adapter.revision is None:
            raise ValueError(f"a token was sampled by {adapter}, not by adapter {ADAPTER!r}: the demo's sessions "
                             "are pinned to it")
        out.append(current - int(adapter.revision))
    return np.asarray(out, dtype=np.int64)


class LoraTrainer(Trainer):
    """The demo's trainer with the adapter as what trains and what each step pushes (a revision per version)."""

    def __init__(self, policy: LoraPolicy, *, lr: float, body_lr: float = 0.0, **kwargs: Any) -> None:
        if body_lr:
            raise ValueError("with --lora the layers stay frozen (--body-lr 0): the adapter is what trains")
        super().__init__(policy, lr=lr, body_lr=0.0, **kwargs)
        self.lora = policy.weights
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
        self.base = copy.deepcopy(policy.model).eval()  # weight version 0, the only one pushed
        self.adapter_dirs: dict[AdapterRevision, Path] = {}
        self.save_revision(0)

    def save_revision(self, revision: int) -> Path:
        path = self.lora.save(self.weights_dir / "adapter" / f"r{revision}")
        self.adapter_dirs[AdapterRevision(ADAPTER, str(revision))] = path
        return path

    def model_of(self, version: Any) -> torch.nn.Module:
        if str(version) != "0":
            raise ValueError(f"weight version {version}: with --lora the base is pushed once, as version 0")
        return self.base

    def filter_stale(self, groups: list[list[Sample]], current: int) -> tuple[list[list[Sample]], StalenessReport]:
        """Staleness in adapter revisions: a group with a token sampled more than `max_staleness` revisions ago is
        dropped."""
        report = StalenessReport()
        kept = []
        for group in groups:
            per_sample = [adapter_staleness(s, current) for s in group]
            if max((int(x.max(initial=0)) for x in per_sample), default=0) > self.max_staleness:
                report.dropped_groups += 1
                report.dropped_samples += len(group)
                continue
            kept.append(group)
            report.kept_groups += 1
            for staleness, count in zip(*np.unique(np.concatenate(per_sample), return_counts=True), strict=True):
                report.tokens_by_staleness[int(staleness)] = report.tokens_by_staleness.get(int(staleness), 0) + int(
                    count)
        return kept, report

    async def push(self, version: int) -> float:
        """Version 0: the warmed-up base weights (revision 0, all zero deltas, is the engine's from its start);
        then a new adapter revision per version, loaded while the episodes run."""
        if version == 0:
            return await super().push(0)
        path = self.save_revision(version)
        result = await self.pusher.push_adapter(path, ADAPTER, str(version), pause=False)
        return result.seconds
