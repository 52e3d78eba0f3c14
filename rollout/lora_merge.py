"""A base model with a PEFT-style LoRA adapter merged in, by hand: `W += B @ A * alpha / r` on each target module.

Why by hand: the trainer check (rollout/logprob_check.py) must score each token with the adapter revision that sampled
it, and neither venv has PEFT; a merge is exact for LoRA (no dropout at inference) and needs only the adapter's two
files: `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`) and `adapter_model.safetensors` (PEFT's names,
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]). Measured against SGLang 0.5.23
serving the same adapters (docs/lora.md): within 1e-3 on every sampled token.

torch is imported here: `import rollout` stays torch-free.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

PEFT_PREFIX = "base_model.model."


def adapter_deltas(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """The weight delta of each target module, by the base model's parameter name (`...q_proj.weight`)."""
    directory = Path(adapter_dir)
    config = json.loads((directory / "adapter_config.json").read_text())
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    if config.get("use_dora"):
        raise ValueError(f"{directory}: DoRA adapters are not merged here (only plain LoRA)")
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    deltas = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        deltas[f"{module}.weight"] = (b.double() @ a.double()) * scale
    if not deltas:
        raise ValueError(f"{directory}: no lora_A / lora_B pairs in adapter_model.safetensors")
    return deltas


def merge_adapter(base: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """A copy of `base` with the adapter merged into its weights (`base` is left as it was)."""
    merged = copy.deepcopy(base)
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for name, delta in adapter_deltas(adapter_dir).items():
            if name not in params:
                raise ValueError(f"{adapter_dir}: the adapter targets {name}, which the base model does not have")
            weight = params[name]
            if tuple(weight.shape) != tuple(delta.shape):
                raise ValueError(f"{adapter_dir}: {name} is {tuple(weight.shape)}, the adapter's delta "
                                 f"{tuple(delta.shape)}")
            weight.add_(delta.to(weight.dtype))
    return merged.eval()
