"""check_logprobs against tiny random transformers models built here: an "engine" decodes token by token with a KV
cache (another computation path than the check's one full forward pass) and records what SGLang records (each
sampled token's logprob, the weight version, for MoE each position's routed experts); the check must find those
samples exact, find and list what was perturbed, score each token with the weights of its own version, and replay
the recorded routing."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from rollout.logprob_check import check_logprobs
from trajectory import Sample, sample_metadata
from trajectory.sample_metadata import BASE_MODEL, AdapterRevision

VOCAB = 96
SMALL: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                         "max_position_embeddings": 256}
LAYERS, TOP_K = 2, 2


def dense(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3Config(**SMALL), dtype=torch.float32).eval()


def moe(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=TOP_K,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # routers start at zero: give them a real preference
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    return model


class Engine:
    """Decodes like the engine: prefill, then one token per step from the KV cache; records logprobs of
    `log_softmax(logits / T)` and, for MoE, the experts each fed position was routed to. `route` may override a
    router's choice (an engine whose routing differs from the trainer's)."""

    def __init__(self, model: torch.nn.Module, route: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.model = model
        self.rows: list[torch.Tensor] = []
        self.layer_rows: list[torch.Tensor] = []
        self.route = route
        self.gates = [layer.mlp.gate for layer in model.model.layers
                      if type(getattr(layer.mlp, "gate", None)).__name__.endswith("Router")]

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        logits, scores, indices = output
        if self.route is not None:
            probs = torch.softmax(logits.float(), dim=-1)
            indices = self.route(probs)
            scores = probs.gather(-1, indices)
            scores = scores / scores.sum(dim=-1, keepdim=True)
        self.layer_rows.append(indices)
        return logits, scores, indices

    def _flush(self) -> None:
        if self.layer_rows:
            self.rows.append(torch.stack(self.layer_rows, dim=1))  # [tokens, layers, top_k]
            self.layer_rows = []

    def generate(self, prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0
                 ) -> tuple[list[int], list[float]]:
        gen = torch.Generator().manual_seed(seed)
        self.rows = []
        hooks = [gate.register_forward_hook(self._record) for gate in self.gates]  # while this engine decodes only
        try:
            return self._decode(prompt, n, temperature, gen)
        finally:
            for hook in hooks:
                hook.remove()

    def _decode(self, prompt: list[int], n: int, temperature: float, gen: torch.Generator
                ) -> tuple[list[int], list[float]]:
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
            self._flush()
            ids: list[int] = []
            logprobs: list[float] = []
            for _ in range(n):
                logits = out.logits[0, -1].float()
                logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
                token = int(logp.argmax()) if temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(token)
                logprobs.append(float(logp[token]))
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
                self._flush()
        return ids, logprobs

    def routed(self, length: int) -> np.ndarray:
        """[length, layers * top_k] as a sample carries them: the rows of every position fed, -1 on the last."""
        rows = torch.cat(self.rows)[: length - 1].reshape(length - 1, -1).numpy().astype(np.int32)
        return np.concatenate([rows, np.full((1, rows.shape[1]), -1, dtype=np.int32)])


def episode(engines: list[tuple[Engine, str]], temperature: float = 0.0, turns: int = 2, new: int = 6,
            routed: bool = False) -> Sample:
    """A merged multi-turn sample: a prompt, then per turn a completion (mask 1) by `engines[turn]` under its
    version and a tool reply (mask 0); metadata as build_merged_sample writes it."""
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, VOCAB, 10)]
    mask = [0] * len(tokens)
    logprobs = [0.0] * len(tokens)
    spans: list[list[Any]] = []
    turn_spans: list[list[int]] = []
    prompt_len = len(tokens)
    rows = None
    for turn in range(turns):
        engine, version = engines[turn % len(engines)]
        ids, lps = engine.generate(tokens, new, temperature, seed=turn)
        turn_spans.append([len(tokens), len(ids)])
        spans.append([version, len(tokens), len(tokens) + len(ids)])
        tokens += ids
        mask += [1] * len(ids)
        logprobs += lps
        if routed:
            rows = engine.routed(len(tokens))
        if turn < turns - 1:
            glue = [int(t) for t in rng.integers(0, VOCAB, 4)]
            tokens += glue
            mask += [0] * len(glue)
            logprobs += [0.0] * len(glue)
    if rows is not None and len(rows) < len(tokens):
        rows = np.concatenate([rows, np.full((len(tokens) - len(rows), rows.shape[1]), -1, dtype=np.int32)])
    return Sample(
        tokens=np.array(tokens, dtype=np.int32), loss_mask=np.array(mask, dtype=np.uint8),
        rollout_log_probs=np.array(logprobs, dtype=np.float32), response_length=len(tokens) - prompt_len,
        status="completed", routed_experts=rows,
        metadata={"num_turns": turns, "turns": turn_spans, "weight_versions": [s[0] for s in spans],
                  "weight_version_spans": spans},
    )


def turn_sample(merged: Sample, k: int) -> Sample:
    """Turn k alone, as build_turn_samples cuts it: that turn's prompt + completion, mask on its completion."""
    start, n = merged.metadata["turns"][k]
    mask = np.zeros(start + n, dtype=np.uint8)
    mask[start:] = 1
    logprobs = np.where(mask == 1, merged.rollout_log_probs[: start + n], 0.0).astype(np.float32)
    return Sample(tokens=merged.tokens[: start + n].copy(), loss_mask=mask, rollout_log_probs=logprobs,
                  response_length=n, status="completed",
                  metadata={"turn": k, "weight_version": merged.metadata["weight_version_spans"][k][0],
                            "prompt_len": start})


VERL = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff", "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min", "rollout_corr/ppl_ratio",
        "rollout_corr/chi2_token", "rollout_corr/chi2_seq", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl",
        "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "train_rollout_logprob_abs_diff")


def test_samples_from_the_same_weights_pass() -> None:
    model = dense(1)
    merged = episode([(Engine(model), "default")])
    samples = [merged, turn_sample(merged, 0), turn_sample(merged, 1)]
    report = check_logprobs(samples, model)
    assert report.ok(1e-4), report.format()
    assert report.metrics["rollout_check/switched_tokens"] == 0
    assert set(VERL) <= set(report.metrics)
    assert report.metrics["rollout_check/tokens"] == 12 + 6 + 6
    assert abs(report.metrics["rollout_corr/k3_kl"]) < 1e-8 and abs(report.metrics["rollout_corr/ppl_ratio"] - 1) < 1e-4
    assert [c.num_tokens for c in report.per_sample] == [12, 6, 6]
    for sample, check in zip(samples, report.per_sample, strict=True):
        np.testing.assert_allclose(check.trainer_log_probs, sample.rollout_log_probs, atol=1e-4)
        assert (check.trainer_log_probs[sample.loss_mask == 0] == 0).all()
    assert len(report.worst) == 10
    assert [w.abs_diff for w in report.worst] == sorted((w.abs_diff for w in report.worst), reverse=True)


def test_perturbed_logprobs_fail_and_are_listed_worst() -> None:
    model = dense(1)
    merged = episode([(Engine(model), "default")])
    sampled = np.flatnonzero(merged.loss_mask)
    bad = {int(sampled[2]): 0.5, int(sampled[9]): -0.05}  # one token of each turn
    for position, delta in bad.items():
        merged.rollout_log_probs[position] += delta
    report = check_logprobs([merged], model, worst=3)
    assert not report.ok(1e-3)
    first, second, third = report.worst
    assert (first.position, second.position) == tuple(bad)
    assert first.abs_diff == pytest.approx(0.5, abs=1e-4) and second.abs_diff == pytest.approx(0.05, abs=1e-4)
    assert (first.turn, second.turn) == (0, 1)
    assert first.token_id == merged.tokens[first.position] and first.weight_version == "default"
    assert first.rollout_log_prob - first.trainer_log_prob == pytest.approx(0.5, abs=1e-4)
    assert third.abs_diff < 1e-4
    assert report.metrics["rollout_check/logprob_abs_diff_max"] == pytest.approx(0.5, abs=1e-4)
    assert report.metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.55 / 12, abs=1e-4)
    assert report.metrics["rollout_corr/k3_kl"] > 1e-3 and report.metrics["rollout_corr/chi2_token"] != 0
    assert report.per_sample[0].abs_diff_max == pytest.approx(0.5, abs=1e-4)
    assert "|diff| 0.5" in report.format()


def test_sampled_tokens_are_scored_at_the_requests_temperature() -> None:
    """SGLang returns log_softmax(logits / T) for a sampled request: the check must divide by the same T."""
    model = dense(1)
    merged = episode([(Engine(model), "default")], temperature=0.7)
    assert check_logprobs([merged], model, temperature=0.7).ok(1e-4)
    assert not check_logprobs([merged], model).ok(1e-2)
    greedy = episode([(Engine(model), "default")])
    assert check_logprobs([greedy], model, temperature=0).ok(1e-4)  # temperature 0 is the raw distribution


def test_each_token_is_scored_by_the_weights_of_its_version() -> None:
    a, b = dense(1), dense(2)
    merged = episode([(Engine(a), "v1"), (Engine(b), "v2")])
    asked: list[Any] = []

    def weights(version: Any) -> torch.nn.Module:
        asked.append(version)
        return {"v1": a, "v2": b}[version]

    report = check_logprobs([merged, turn_sample(merged, 1)], weights)
    assert report.ok(1e-4), report.format()
    assert asked == ["v1", "v2", "v2"]  # per sample, once per version
    assert report.per_sample[0].weight_versions == ("v1", "v2")
    # One set of weights for all: the tokens of the other version are the ones that disagree.
    stale = check_logprobs([merged], a, worst=6)
    assert not stale.ok(1e-2)
    assert {w.weight_version for w in stale.worst} == {"v2"} and {w.turn for w in stale.worst} == {1}


def test_a_version_switch_inside_one_turn() -> None:
    """Weights updated mid-reply (SGLang's weight_versions spans): the turn's tokens split between two models."""
    a, b = dense(1), dense(2)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 8)]
    head, head_lp = Engine(a).generate(prompt, 4)
    tail, tail_lp = Engine(b).generate(prompt + head, 4)
    tokens = prompt + head + tail
    sample = Sample(
        tokens=np.array(tokens, dtype=np.int32), loss_mask=np.array([0] * 8 + [1] * 8, dtype=np.uint8),
        rollout_log_probs=np.array([0.0] * 8 + head_lp + tail_lp, dtype=np.float32), response_length=8,
        status="completed",
        metadata={"turns": [[8, 8]], "weight_version_spans": [["default", 8, 12], ["step-2", 12, 16]]})
    report = check_logprobs([sample], {"default": a, "step-2": b}.__getitem__)
    assert report.ok(1e-4), report.format()
    assert report.metrics["rollout_check/switched_tokens"] == 4 and report.per_sample[0].switched_tokens == 4
    assert not check_logprobs([sample], b).ok(1e-2)
    # Scored by the old weights alone, only the tokens after the switch disagree, and they are the ones flagged.
    stale = check_logprobs([sample], a, worst=4)
    assert not stale.ok(1e-2) and stale.ok(1e-4, switched=False)
    assert {(w.position >= 12, w.switched) for w in stale.worst} == {(True, True)}
    assert "4 tokens sampled after their turn's weights changed" in stale.format()


def top_k_after_the_best(probs: torch.Tensor) -> torch.Tensor:
    """An engine that routes each token to the 2nd and 3rd best experts: a routing the trainer's router never picks."""
    return probs.topk(TOP_K + 1, dim=-1).indices[:, 1:]


def test_moe_routing_is_replayed_from_the_recorded_experts() -> None:
    model = moe(3)
    same = episode([(Engine(model), "default")], routed=True)
    assert same.routed_experts is not None and same.routed_experts.shape == (len(same.tokens), LAYERS * TOP_K)
    replayed = check_logprobs([same], model)
    assert replayed.ok(1e-4) and replayed.per_sample[0].replayed
    assert replayed.metrics["rollout_check/routing_mismatch_fraction"] == 0.0
    # An engine that routed otherwise: only the replay reproduces its logprobs.
    other = episode([(Engine(model, route=top_k_after_the_best), "default")], routed=True)
    with_replay = check_logprobs([other], model)
    without = check_logprobs([other], model, replay_routing=False)
    assert with_replay.ok(1e-4), with_replay.format()
    assert not without.ok(1e-2) and not without.per_sample[0].replayed
    # (not quite all rows: past the first layer the trainer routes other hidden states, and may land on the same)
    assert without.metrics["rollout_check/routing_mismatch_fraction"] > 0.9
    assert without.metrics["rollout_corr/k3_kl"] > with_replay.metrics["rollout_corr/k3_kl"]
    # The replay hooks are gone afterwards: the model routes by itself again.
    assert check_logprobs([same], model, replay_routing=False).ok(1e-4)


def test_replay_renormalises_only_under_norm_topk_prob() -> None:
    model = moe(3)
    other = episode([(Engine(model, route=top_k_after_the_best), "default")], routed=True)
    for layer in model.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    assert not check_logprobs([other], model).ok(1e-3)  # the engine renormalised its weights; this model does not


def test_routed_experts_need_a_router_to_replay_into() -> None:
    model = dense(1)
    sample = episode([(Engine(model), "default")])
    sample.routed_experts = np.zeros((len(sample.tokens), LAYERS * TOP_K), dtype=np.int32)
    with pytest.raises(ValueError, match="no top-k router"):
        check_logprobs([sample], model)
    assert check_logprobs([sample], model, replay_routing=False).ok(1e-4)


def test_no_sampled_token_and_bad_arguments() -> None:
    model = dense(1)
    empty = Sample(tokens=np.arange(5, dtype=np.int32), loss_mask=np.zeros(5, dtype=np.uint8),
                   rollout_log_probs=np.zeros(5, dtype=np.float32), response_length=0, status="aborted")
    report = check_logprobs([empty], model)
    assert report.ok() and report.worst == [] and report.metrics["rollout_check/tokens"] == 0
    with pytest.raises(ValueError, match="temperature"):
        check_logprobs([empty], model, temperature=-1)
    with pytest.raises(TypeError, match="policy"):
        check_logprobs([empty], "model")  # type: ignore[arg-type]


def test_import_rollout_stays_torch_free() -> None:
    code = "import sys, rollout; rollout.__dict__; assert 'torch' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


def masked_episode(model: torch.nn.Module, top_k: int, temperature: float = 1.0, new: int = 8) -> Sample:
    """Sampled under top-k as SGLang samples: from the top_k tokens renormalised; each sampled token records its row
    (the kept ids), its full-vocabulary logprob and its logprob over the row (trajectory/sampling_masks.py)."""
    gen = torch.Generator().manual_seed(3)
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 10)]
    prompt = len(tokens)
    full, support, rows = [0.0] * prompt, [0.0] * prompt, [[] for _ in range(prompt)]
    with torch.no_grad():
        for _ in range(new):
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1].float() / temperature, -1)
            row = torch.topk(logp, top_k).indices
            kept = logp[row] - torch.logsumexp(logp[row], -1)
            token = int(row[torch.multinomial(kept.exp(), 1, generator=gen)])
            tokens.append(token)
            full.append(float(logp[token]))
            support.append(float(logp[token] - torch.logsumexp(logp[row], -1)))
            rows.append(row.tolist())
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return Sample(tokens=np.array(tokens, dtype=np.int32), loss_mask=np.array([0] * prompt + [1] * new, np.uint8),
                  rollout_log_probs=np.array(full, np.float32), response_length=new, status="completed",
                  metadata={"num_turns": 1, "turns": [[prompt, new]], "weight_version_spans": [["w", prompt,
                                                                                                  prompt + new]]},
                  sampling_mask_ids=np.array([i for r in rows for i in r], np.int32), sampling_mask_offsets=offsets,
                  sampling_log_probs=np.array(support, np.float32))


def test_sampling_masks_are_recomputed_over_their_rows() -> None:
    """Under top-k the engine's sampling logprob is the row-renormalised one: the support recompute matches it, the
    full-vocabulary one misses it by the row's missing mass (the bias a ratio without masks carries)."""
    model = dense(1)
    sample = masked_episode(model, top_k=5, temperature=0.8)
    report = check_logprobs([sample], model, temperature=0.8)
    assert report.ok(1e-4) and report.ok_support(1e-4), report.format()
    assert report.metrics["rollout_check/support_tokens"] == 8
    assert report.metrics["rollout_check/unmasked_logprob_abs_diff_mean"] > 0.1
    assert "over the sampling masks (8 tokens)" in report.format()
    assert not check_logprobs([sample], model, temperature=1.0).ok_support(1e-2)  # another temperature
    wrong = masked_episode(model, top_k=5, temperature=0.8)
    assert wrong.sampling_mask_ids is not None
    wrong.sampling_mask_ids[wrong.sampling_mask_offsets[-2]] = (wrong.tokens[-1] + 1) % VOCAB  # type: ignore[index]
    assert not check_logprobs([wrong], model, temperature=0.8).ok_support(1e-3)  # a row the engine did not keep
    assert "rollout_check/support_tokens" not in check_logprobs([episode([(Engine(model), "default")])],
                                                                model).metrics


def test_the_grpo_pieces_use_support_normalised_ratios() -> None:
    """to_torch_batch pads each row's CSR; sampled_log_probs renormalised over the rows gives the engine's sampling
    logprobs back, so the truncated importance weights of an on-policy batch are 1 (without the rows they are not)."""
    from rollout import to_torch_batch
    from rollout.grpo import sampled_log_probs, truncated_is_weights

    model = dense(1)
    masked = masked_episode(model, top_k=5)
    plain = episode([(Engine(model), "default")])
    batch = to_torch_batch([masked, plain])
    n = len(masked.tokens)
    assert batch["sampling_mask_offsets"].shape == (2, batch["input_ids"].shape[1] + 1)
    assert batch["sampling_mask_offsets"][0, : n + 1].tolist() == masked.sampling_mask_offsets.tolist()  # type: ignore
    assert (batch["sampling_mask_offsets"][1] == 0).all() and (batch["sampling_mask_ids"][1] == -1).all()
    assert (batch["sampling_mask_offsets"][0, n:] == masked.sampling_mask_offsets[-1]).all()  # type: ignore[index]
    with torch.no_grad():
        support = sampled_log_probs(model, batch["input_ids"], batch["loss_mask"], batch["attention_mask"],
                                    sampling_masks=(batch["sampling_mask_ids"], batch["sampling_mask_offsets"]))
        full = sampled_log_probs(model, batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
    np.testing.assert_allclose(support[0, :n].numpy(), masked.sampling_log_probs, atol=1e-4)  # type: ignore[arg-type]
    np.testing.assert_allclose(support[1], full[1], atol=1e-6)  # no rows: the full softmax
    mask = batch["loss_mask"][:1]
    weights = truncated_is_weights(support[:1], batch["sampling_log_probs"][:1], mask)
    assert torch.allclose(weights[mask == 1], torch.ones(8), atol=1e-3)
    assert (truncated_is_weights(full[:1], batch["sampling_log_probs"][:1], mask)[mask == 1] < 0.99).all()


# -- LoRA adapters (issue 40) -----------------------------------------------------------------------------------
def write_adapter(directory: Path, seed: int, r: int = 4, alpha: int = 8) -> dict[str, tuple[torch.Tensor, ...]]:
    """A PEFT-style adapter on q_proj and v_proj of the SMALL model; returns module name -> (A, B, scale)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    outs = {"q_proj": SMALL["num_attention_heads"] * SMALL["head_dim"],
            "v_proj": SMALL["num_key_value_heads"] * SMALL["head_dim"]}
    tensors, pairs = {}, {}
    for layer in range(SMALL["num_hidden_layers"]):
        for module, out in outs.items():
            name = f"model.layers.{layer}.self_attn.{module}"
            a = torch.randn(r, SMALL["hidden_size"], generator=g) * 0.5
            b = torch.randn(out, r, generator=g) * 0.5
            tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"] = a, b
            pairs[name] = (a, b, torch.tensor(alpha / r))
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": alpha, "peft_type": "LORA"}))
    return pairs


@contextlib.contextmanager
def lora_hooks(model: torch.nn.Module, pairs: dict[str, tuple[torch.Tensor, ...]]) -> Iterator[None]:
    """The adapter applied as SGLang applies it, beside the base weights (y += x A^T B^T * scale), not merged."""
    modules = dict(model.named_modules())

    def hook(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> Any:
        return lambda _m, inputs, output: output + (inputs[0] @ a.T @ b.T) * scale

    handles = [modules[name].register_forward_hook(hook(*pair)) for name, pair in pairs.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_each_token_is_scored_with_the_adapter_revision_that_sampled_it(tmp_path: Path) -> None:
    base = dense(1)
    a1, a1_next = AdapterRevision("a1", "0"), AdapterRevision("a1", "1")
    dirs = {a1: tmp_path / "a1", a1_next: tmp_path / "a1@1"}
    pairs = {a1: write_adapter(dirs[a1], 10), a1_next: write_adapter(dirs[a1_next], 11)}
    order = iter([None, a1, a1_next])  # turn 0 by the base model, then a1 revision 0, then revision 1
    engine = Engine(base)
    decode = engine.generate

    def generate(prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> tuple[list[int], list[float]]:
        adapter = next(order)
        if adapter is None:
            return decode(prompt, n, temperature, seed)
        with lora_hooks(base, pairs[adapter]):
            return decode(prompt, n, temperature, seed)

    engine.generate = generate  # type: ignore[method-assign]
    merged = episode([(engine, "default")], turns=3)
    merged.metadata["adapters"] = [None, ["a1", "0"], ["a1", "1"]]
    last = turn_sample(merged, 2)
    last.metadata["adapter"] = ["a1", "1"]
    report = check_logprobs([merged, last], base, adapters=dirs)
    assert report.ok(1e-4), report.format()
    assert report.metrics["rollout_check/tokens"] == 3 * 6 + 6
    assert sample_metadata(merged).adapters() == {BASE_MODEL, a1, a1_next}
    # Scored with revision 0 for both, the tokens of revision 1 disagree; without `adapters` the check refuses.
    stale = check_logprobs([merged], base, adapters={a1: dirs[a1], a1_next: dirs[a1]})
    assert not stale.ok(1e-3)
    with pytest.raises(ValueError, match="pass adapters="):
        check_logprobs([merged], base)
