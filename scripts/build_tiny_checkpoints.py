"""Build tiny randomly initialised Qwen3 checkpoints from our offline Qwen3 tokenizer, for the real-engine test tier.

Real SGLang on CPU serves a model it loads from a directory like any Hugging Face checkpoint; nothing may come from a
model hub, and the tests need no trained weights (greedy decoding of random weights is deterministic, which is all an
exact token-level check needs). So the checkpoints are built here in seconds, with the config classes of the
`transformers` SGLang runs with, next to a copy of `.cache/tokenizers/qwen3`:

- `qwen3-dense`: Qwen3 (hidden 64, 2 layers, 4 heads, 2 KV heads), tied embeddings;
- `qwen3-dense-b`: the same architecture from another seed (the target of a real `/update_weights_from_disk`);
- `qwen3-moe`: Qwen3-MoE (4 experts, top-2) with `tie_word_embeddings=False`: SGLang's Qwen3-MoE always owns an
  `lm_head`, and with tied embeddings it would be left unloaded (every logprob null, every sampled id 0).

Run with the real-engine venv's interpreter (it has torch and SGLang's transformers):

    .venv-sglang/bin/python -m scripts.build_tiny_checkpoints --tokenizer .cache/tokenizers/qwen3 --out .cache/ckpt

Each directory is rebuilt only when its `.built` stamp is missing or names another recipe.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

# hidden 64, 2 layers, 4 heads of 16, 2 KV heads; a context long enough for multi-turn tests, short enough that a
# reply without max_tokens ends in seconds on a CPU.
COMMON: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "dtype": "float32",
}
MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": []}
RECIPES: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen3-dense": ("qwen3", {"tie_word_embeddings": True}, 1),
    "qwen3-dense-b": ("qwen3", {"tie_word_embeddings": True}, 2),
    "qwen3-moe": ("qwen3_moe", {**MOE, "tie_word_embeddings": False}, 3),
}


def build(name: str, tokenizer_dir: Path, tokenizer: Any, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    kind, extra, seed = RECIPES[name]
    vocab = (len(tokenizer) + 63) // 64 * 64  # special tokens included, padded as real checkpoints pad it
    target = out / name
    recipe = json.dumps({"kind": kind, "common": COMMON, "extra": extra, "seed": seed, "vocab": vocab},
                        sort_keys=True)
    stamp = target / ".built"
    if stamp.exists() and stamp.read_text() == recipe:
        return target
    shutil.rmtree(target, ignore_errors=True)
    config_class = Qwen3MoeConfig if kind == "qwen3_moe" else Qwen3Config
    config = config_class(vocab_size=vocab, **COMMON, **extra)
    for role in ("bos", "eos", "pad"):  # the generation config SGLang reads its stop ids from
        token = getattr(tokenizer, f"{role}_token")
        setattr(config, f"{role}_token_id", None if token is None else tokenizer.convert_tokens_to_ids(token))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, target / f.name)
    stamp.write_text(recipe)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="the Qwen3 tokenizer dir (scripts.build_tokenizers)")
    p.add_argument("--out", type=Path, required=True, help="where the checkpoint directories go")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    for name in RECIPES:
        print(f"{name}: {build(name, args.tokenizer, tokenizer, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
