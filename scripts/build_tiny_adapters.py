"""Build tiny random PEFT-style LoRA adapters for the `qwen3-dense` test checkpoint (issue 40).

Rank 4, alpha 8, on `q_proj` and `v_proj` of every layer, `lora_B` random and non-zero (PEFT would start it at zero,
which changes nothing) and scaled so an adapter visibly moves the logprobs. One directory per adapter revision:

- `a1`: adapter a1, revision 0; `a1@1`: its next revision (what a trainer would push); `a2`: a second adapter.

They are written to a temporary directory beside `--out` and renamed into place, and only when `--out` does not
exist: a shared cache is never rebuilt in place while another run reads it. Run with an interpreter that has torch
and safetensors (the real-engine venv):

    .venv-sglang/bin/python -m scripts.build_tiny_adapters --base .cache/checkpoints/qwen3-dense \
        --out .cache/checkpoints/lora-qwen3-dense
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "v_proj")
# directory -> seed of its random A and B
ADAPTERS = {"a1": 10, "a1@1": 11, "a2": 20}


def build_adapter(base: Path, out: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    hidden, layers, head_dim = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, hidden, generator=g) * 0.5).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(outs[module], RANK, generator=g) * 0.5).contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": RANK,
        "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(TARGETS), "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True,
    }, indent=2))


def build(base: Path, out: Path) -> Path:
    """Every adapter of ADAPTERS under `out`, built only when `out` is absent (atomically: temp dir, then rename)."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
    try:
        for name, seed in ADAPTERS.items():
            build_adapter(base, tmp / name, seed)
        try:
            os.rename(tmp, out)
        except OSError:  # another run renamed its own copy into place first: theirs is as good
            if not out.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the qwen3-dense checkpoint dir")
    p.add_argument("--out", type=Path, required=True, help="the adapters' directory (left alone if it exists)")
    args = p.parse_args(argv)
    print(f"adapters: {build(args.base, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
