"""Build tiny randomly initialised Qwen3 checkpoints from our offline Qwen3 tokenizer, for the real-engine test tier.

Real SGLang on CPU serves a model it loads from a directory like any Hugging Face checkpoint; nothing may come from a
model hub, and the tests need no trained weights (greedy decoding of random weights is deterministic, which is all an
exact token-level check needs). So the checkpoints are built here in seconds, with the config classes of the
`transformers` SGLang runs with, next to a copy of `.cache/tokenizers/qwen3`:

- `qwen3-dense`: Qwen3 (hidden 64, 2 layers, 4 heads, 2 KV heads), tied embeddings;
- `qwen3-dense-b`: the same architecture from another seed (the target of a real `/update_weights_from_disk`);
- `qwen3-moe`: Qwen3-MoE (4 experts, top-2) with `tie_word_embeddings=False`: SGLang's Qwen3-MoE always owns an
  `lm_head`, and with tied embeddings it would be left unloaded (every logprob null, every sampled id 0);
- `qwen3-vl`: Qwen3-VL (`Qwen3VLForConditionalGeneration`): the dense text sizes with interleaved mRoPE sections
  [2, 3, 3] (head_dim 16 rotates 8 pairs), tied embeddings, and a 2-block patch-16 vision tower (hidden 64, 4 heads,
  spatial merge 2, temporal patch 2, out hidden 64, deepstack from block 0), with the published Qwen3-VL image
  processor config (trajectory/image_grid.py writes it) saved beside it. SGLang serves it with
  `--mm-attention-backend sdpa`.

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
# Qwen3-VL's vision tower, shrunk: the published patch/merge/temporal sizes, 2 blocks of hidden 64.
VISION: dict[str, Any] = {
    "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "in_channels": 3, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "deepstack_visual_indexes": [0],
    "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
}
MROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": COMMON["rope_theta"], "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True}
RECIPES: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen3-dense": ("qwen3", {"tie_word_embeddings": True}, 1),
    "qwen3-dense-b": ("qwen3", {"tie_word_embeddings": True}, 2),
    "qwen3-moe": ("qwen3_moe", {**MOE, "tie_word_embeddings": False}, 3),
    "qwen3-vl": ("qwen3_vl", {"tie_word_embeddings": True, "vision": VISION, "rope_parameters": MROPE}, 4),
}


def build(name: str, tokenizer_dir: Path, tokenizer: Any, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    kind, extra, seed = RECIPES[name]
    vocab = (len(tokenizer) + 63) // 64 * 64  # special tokens included, padded as real checkpoints pad it
    target = out / name
    processor = _image_processor_config() if kind == "qwen3_vl" else None
    recipe = json.dumps({"kind": kind, "common": COMMON, "extra": extra, "seed": seed, "vocab": vocab,
                         **({"processor": processor} if processor else {})}, sort_keys=True)
    stamp = target / ".built"
    if stamp.exists() and stamp.read_text() == recipe:
        return target
    shutil.rmtree(target, ignore_errors=True)
    ids = {}
    for role in ("bos", "eos", "pad"):  # the generation config SGLang reads its stop ids from
        token = getattr(tokenizer, f"{role}_token")
        ids[f"{role}_token_id"] = None if token is None else tokenizer.convert_tokens_to_ids(token)
    torch.manual_seed(seed)
    if kind == "qwen3_vl":
        model = _vision_language_model(extra, vocab, ids, tokenizer)
    else:
        config_class = Qwen3MoeConfig if kind == "qwen3_moe" else Qwen3Config
        config = config_class(vocab_size=vocab, **COMMON, **extra)
        for key, value in ids.items():
            setattr(config, key, value)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, target / f.name)
    if processor is not None:
        (target / "preprocessor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True))
    stamp.write_text(recipe)
    return target


def _image_processor_config() -> dict[str, Any]:
    """The published Qwen3-VL image processor config (patch 16, merge 2, 256^2..4096^2 pixels, mean/std 0.5)."""
    from trajectory.image_grid import QWEN3_VL

    return QWEN3_VL.preprocessor_config()


def _vision_language_model(extra: dict[str, Any], vocab: int, ids: dict[str, int | None], tokenizer: Any) -> Any:
    """A random `Qwen3VLForConditionalGeneration` whose image/vision ids are the tokenizer's own."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = {k: v for k, v in COMMON.items() if k not in ("rope_theta", "dtype")}
    text.update(vocab_size=vocab, rope_parameters=extra["rope_parameters"], tie_word_embeddings=True, **ids)
    marks = {key: tokenizer.convert_tokens_to_ids(token) for key, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen3VLConfig(text_config=text, vision_config=extra["vision"], tie_word_embeddings=True, **marks)
    config.dtype = "float32"
    for key, value in ids.items():
        setattr(config, key, value)
    return Qwen3VLForConditionalGeneration(config).to(torch.float32)


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
