"""examples/demo_rl/lora.py: the policy's hooked low-rank deltas are what the saved PEFT adapter merges into."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from examples.demo_rl.lora import ADAPTER, LoraConfig, LoraPolicy, LoraWeights
from examples.demo_rl.policy import AlphabetPolicy
from rollout.lora_merge import merge_adapter

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def _policy(tmp_path: Path) -> tuple[AlphabetPolicy, Path]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**SMALL), dtype=torch.float32).eval()
    checkpoint = tmp_path / "base"
    model.save_pretrained(checkpoint)
    return AlphabetPolicy(model, range(20)), checkpoint


def test_revision_0_is_the_base_and_a_trained_one_is_what_its_saved_adapter_merges(tmp_path: Path) -> None:
    policy, checkpoint = _policy(tmp_path)
    ids = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12)
    mask[:, :4] = 0
    base = policy.log_probs(ids, mask).detach()
    every = ("q_proj", "k_proj", "v_proj", "o_proj")  # each projection's shape (kv heads are fewer)
    lora = LoraPolicy(policy, LoraWeights(LoraConfig(rank=2, alpha=4.0, targets=every), checkpoint, seed=0))
    assert len(lora.targets) == 8 and lora.model.config.num_hidden_layers == 2
    assert torch.equal(lora.log_probs(ids, mask).detach(), base)  # B starts at zero

    loss = -(lora.log_probs(ids, mask) * mask).sum()
    loss.backward()
    assert all(p.grad is None for p in lora.model.parameters()) and lora.rows.grad is None
    assert all(b.grad is not None and b.grad.abs().sum() > 0 for b in lora.weights.b.values())
    with torch.no_grad():
        for b in lora.weights.b.values():
            b.normal_(0.0, 0.2)
    adapted = lora.log_probs(ids, mask).detach()
    assert (adapted - base).abs().max() > 1e-3
    assert torch.equal(policy.log_probs(ids, mask).detach(), base)  # the hooks are gone outside log_probs

    saved = lora.weights.save(tmp_path / "r1")
    merged = AlphabetPolicy(merge_adapter(policy.model, saved), range(20))
    torch.testing.assert_close(merged.log_probs(ids, mask), adapted, atol=1e-5, rtol=0)


def test_a_target_outside_the_attention_is_refused(tmp_path: Path) -> None:
    _, checkpoint = _policy(tmp_path)
    with pytest.raises(ValueError, match="no LoRA target 'gate_proj'"):
        LoraWeights(LoraConfig(targets=("o_proj", "gate_proj")), checkpoint, seed=0)


def test_the_engine_and_the_server_are_told_the_adapter() -> None:
    config = LoraConfig(rank=4, max_loaded=6)
    args = config.engine_args(Path("/w/r0"))
    assert args[:3] == ("--enable-lora", "--lora-paths", f"{ADAPTER}=/w/r0")
    assert args[args.index("--lora-target-modules") + 1:args.index("--lora-backend")] == ("o_proj",)
    assert args[args.index("--max-loaded-loras") + 1] == "6" and args[args.index("--max-lora-rank") + 1] == "4"
    assert LoraConfig.server_args() == ("--lora-adapter", ADAPTER, "--adapter-revisions", "latest")
