"""rollout.adapters.trl against TRL 1.16.0: real samples into the rollout dict, and a real `GRPOTrainer` (a tiny random
Qwen3 on the CPU, the real Qwen3 tokenizer) training two steps on `make_rollout_func`: every prompt one session on a
live server, the model pushed into the engine after step 1 through the session server's pause / update / continue,
the second rollout's tokens sampled under that version."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trainer_agents
from datasets import Dataset
from sample_checks import (
    Episodes,
    assert_split,
    assert_tool_sample,
    expected_adapter_labels,
    expected_token_versions,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
from trl import GRPOConfig, GRPOTrainer

from rollout.adapters import trl as adapter

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_tool_episode_field_for_field(episodes: Episodes) -> None:
    (sample,) = episodes.tool.samples
    assert_tool_sample(sample)
    out = adapter.to_rollout_output([episodes.tool.samples], [episodes.tool.reward])
    assert {"prompt_ids", "completion_ids", "logprobs"} <= set(out)  # what GRPOTrainer requires
    assert_split(sample, out["prompt_ids"][0], out["completion_ids"][0], out["env_mask"][0], out["logprobs"][0])
    p = len(out["prompt_ids"][0])
    assert out["weight_versions"][0] == expected_token_versions(sample)[p:]
    assert out["rollout_reward"] == [trainer_agents.REWARD]


def test_an_adapter_sampled_row_names_each_completion_tokens_revision(episodes: Episodes) -> None:
    (lora,), (base,) = episodes.lora.samples, episodes.tool.samples
    out = adapter.to_rollout_output([[lora], [base]], [1.0, 0.0])
    p, q = len(out["prompt_ids"][0]), len(out["prompt_ids"][1])
    assert out["adapter_revisions"][0] == expected_adapter_labels(lora)[p:]  # "a1@0" on every sampled token
    assert out["adapter_revisions"][1] == expected_adapter_labels(base)[q:]  # "" on the base model's
    assert {x for x in out["adapter_revisions"][0] if x is not None} == {"a1@0"}
    assert "adapter_revisions" not in adapter.to_rollout_output([[base]])


def test_a_compacted_session_is_not_one_trl_row(episodes: Episodes) -> None:
    with pytest.raises(ValueError, match="compacted or forked"):
        adapter.to_rollout_output([episodes.compacted.samples])


def test_grpo_trainer_trains_on_sessions_and_pushes_its_weights(episodes: Episodes, tokenizer_dirs: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    stack = episodes.stack
    httpx.post(f"{stack.engine}/update_weight_version", json={"new_version": "0", "abort_all_requests": False},
               timeout=30).raise_for_status()
    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["qwen3"])
    config = Qwen3Config(vocab_size=len(tok), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    seen: list[dict[str, Any]] = []

    def reward(completions: list[Any], rollout_reward: list[float], weight_versions: list[list[str | None]],
               completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        seen.append({"versions": weight_versions, "ids": completion_ids})
        return list(rollout_reward)

    rollout_func = adapter.make_rollout_func(stack.server, "trainer_agents.short_tool_agent", engine_url=stack.engine,
                                             checkpoint_dir=tmp_path / "weights",
                                             sampling_params={"max_new_tokens": 64})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_steps=2, report_to=[], use_cpu=True, save_strategy="no", bf16=False, logging_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": "fix it"}, {"prompt": "ship it"}] * 2),
                          rollout_func=rollout_func)
    trainer.train()

    assert len(seen) == 2 and all(len(s["ids"]) == 2 for s in seen)
    versions_per_step = [{v for row in s["versions"] for v in row if v is not None} for s in seen]
    assert versions_per_step == [{"0"}, {"1"}]  # step 1's weights were pushed before the second rollout
    assert (tmp_path / "weights" / "step-1" / "model.safetensors").exists()
    assert httpx.get(f"{stack.engine}/model_info", timeout=30).json()["weight_version"] == "1"
    for s in seen:  # tool output inside each completion is in the row, masked for TRL (None version, env_mask 0)
        assert all(any(v is None for v in row) for row in s["versions"])
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["reward"] for h in logged] == [trainer_agents.REWARD] * 2
