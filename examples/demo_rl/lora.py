"""`--lora`: RL trains a rank-r LoRA adapter on the attention's output projections instead of the alphabet's rows.

The base weights stay as the warm-up left them (pushed once, as weight version 0); each step saves the adapter in
PEFT's format (the two files SGLang's `/load_lora_adapter` and rollout/lora_merge.py read) and pushes it as the next
revision of one adapter (`WeightPusher.push_adapter`, no pause: loading under a new name touches no running request).
The session server is started with `--lora-adapter NAME --adapter-revisions latest`, so every session starts on the
newest revision and each next turn moves to the newest one then; the check scores each token with the base plus the
revision that sampled it, and staleness is counted in revisions. PEFT is not installed: the low-rank deltas are added
by forward hooks on the target projections, only while the trainer computes logprobs, so the model itself (its
copies, its saved weights) stays the base.

Why o_proj and not q/v, and why a sharper warm-up (`WARMUP_LR`): the alphabet's rows and the final norm are frozen, so
an adapter can only turn the last hidden state, never lengthen it, and every token outside the alphabet keeps its
logit 0 (together, log(151k) = 11.9). After the rows' warm-up at 3e-3 the call's row is nearly parallel to the
items' (cosine 0.85) and short (its logit at most 15.2 against the items' 17.7): the best any hidden state can do at
the reply's first token is P(call) 0.74 with 0.12 on tokens outside the alphabet, which caps the reward near 0.75
however the adapter trains. A warm-up at 1e-2 (same demonstrations, same ~10% of calls at the start) leaves the rows
long enough for the call to dominate; an adapter on o_proj writes the residual stream directly where q/v reach it
through the attention pattern and o_proj (an offline prototype of the loop, episodes sampled in torch, seeds 0-2:
q/v did not rise from that start at 3e-3 or 1e-2; o_proj at 2e-2 rose to 0.81-0.88 over the last three steps).
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
from examples.demo_rl.rollouts import Group
from examples.demo_rl.step_record import StepRecord
from examples.demo_rl.trainer import Trainer
from rollout.grpo import StalenessReport
from trajectory import Sample, sample_metadata
from trajectory.sample_metadata import AdapterRevision

ADAPTER = "policy"                  # the adapter's name in the engine (`--lora-paths policy=DIR`) and the server
WARMUP_LR = 1e-2                    # the warm-up's learning rate with --lora (the module's docstring says why)
PEFT_PREFIX = "base_model.model."   # rollout/lora_merge.py reads PEFT's tensor names


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 4
    alpha: float = 8.0
    lr: float = 2e-2
    max_loaded: int = 6             # the engine's --max-loaded-loras and --max-loras-per-batch
    targets: tuple[str, ...] = ("o_proj",)  # each layer's attention projections the adapter adds to

    def engine_args(self, first_revision: Path) -> tuple[str, ...]:
        """The engine's LoRA flags (docs/lora.md: torch_native on a CPU, the test plugin's pin_memory patch)."""
        return ("--enable-lora", "--lora-paths", f"{ADAPTER}={first_revision}", "--max-lora-rank", str(self.rank),
                "--lora-target-modules", *self.targets, "--lora-backend", "torch_native",
                "--max-loaded-loras", str(self.max_loaded), "--max-loras-per-batch", str(self.max_loaded))

    @staticmethod
    def server_args() -> tuple[str, ...]:
        """Every session on the adapter, each turn on its newest revision (a turn keeps one revision throughout)."""
        return ("--lora-adapter", ADAPTER, "--adapter-revisions", "latest")


class LoraWeights:
    """The adapter's A [r, in] and B [out, r] per target module, by module name (`model.layers.0.self_attn.q_proj`).

    A starts as PEFT's (uniform in +-1/sqrt(in)), B at zero: revision 0 is the base model exactly."""

    def __init__(self, config: LoraConfig, checkpoint: Path, seed: int) -> None:
        cfg = json.loads((checkpoint / "config.json").read_text())
        hidden, head_dim = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        heads, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
        shapes = {"q_proj": (hidden, heads), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (heads, hidden)}
        unknown = [t for t in config.targets if t not in shapes]
        if unknown:
            raise ValueError(f"no LoRA target {unknown[0]!r} here: the attention's {', '.join(shapes)}")
        self.config = config
        self.scale = config.alpha / config.rank
        g = torch.Generator().manual_seed(seed)
        self.a: dict[str, torch.nn.Parameter] = {}
        self.b: dict[str, torch.nn.Parameter] = {}
        for layer in range(cfg["num_hidden_layers"]):
            for target in config.targets:
                name = f"model.layers.{layer}.self_attn.{target}"
                fan_in, fan_out = shapes[target]
                bound = 1 / math.sqrt(fan_in)
                self.a[name] = torch.nn.Parameter((torch.rand(config.rank, fan_in, generator=g) * 2 - 1) * bound)
                self.b[name] = torch.nn.Parameter(torch.zeros(fan_out, config.rank))

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
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "target_modules": list(self.config.targets),
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

    async def step(self, step: int, groups: list[Group]) -> StepRecord:
        record = await super().step(step, groups)
        record.episodes_across_revisions = sum(
            len({a for s in r.samples for a in sample_metadata(s).adapters()}) > 1 for g in groups for r in g.results)
        return record

    async def push(self, version: int) -> float:
        """Version 0: the warmed-up base weights (revision 0, all zero deltas, is the engine's from its start);
        then a new adapter revision per version, loaded while the episodes run."""
        if version == 0:
            return await super().push(0)
        path = self.save_revision(version)
        result = await self.pusher.push_adapter(path, ADAPTER, str(version), pause=False)
        return result.seconds
