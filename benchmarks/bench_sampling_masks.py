"""What sampling masks cost in samples: bytes per sampled token at top-k 20, 50 and 512, JSON and safetensors.

A multi-turn tool episode is played through `LinearTrajectory` (replies in the family's format, tool results
between turns) twice: once without masks, once with a kept set of `k` ids per sampled token, as the engine reports
them at that top-k when top-p does not bind (the worst case: SGLang's rows are at most top-k long). The merged
sample is encoded both ways; the figure is the difference in bytes over the sampled tokens. The server's memory for
them is reported beside it (the trajectory's arrays, which include the per-position offsets). Sizes are exact
counts, not timings, so the figures do not depend on the machine.

    python -m benchmarks.bench_sampling_masks --tokenizers .cache/tokenizers [--json reports/masks.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from benchmarks.benchlib import Figures, print_figures, tool_schemas
from trajectory import (
    GenerateResult,
    LinearTrajectory,
    ModelFamily,
    TurnPlan,
    build_merged_sample,
    get_family,
    samples_to_json,
    samples_to_safetensors,
)
from trajectory.sampling_masks import SamplingMasks

TOP_KS = (20, 50, 512)
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu")


def engine_reply(family: ModelFamily, plan: TurnPlan, content: str, calls: tuple[tuple[str, str], ...], rid: str,
                 k: int | None, rng: np.random.Generator) -> tuple[GenerateResult, dict[str, Any]]:
    """The engine's result for `plan`: the family's formatted reply and its stop token, and with `k` a kept set of k
    distinct ids per token (the sampled id first, the others a run at a random place in the vocabulary)."""
    text = family.format_completion(content, None, list(calls))
    ids = [*family.encode(text), family.stop_token_after(text)]
    masks = None
    if k is not None:
        vocab = family.vocab_size
        rows = [[t, *((t + 1 + int(rng.integers(0, vocab - k)) + np.arange(k - 1)) % vocab).tolist()] for t in ids]
        masks = SamplingMasks.from_rows(rows, [-0.5] * len(ids))
    result = GenerateResult(text=text, output_ids=np.asarray(ids, np.int32), logprobs=np.full(len(ids), -0.25,
                            np.float32), finish_reason={"type": "stop", "matched": ids[-1]},
                            prompt_tokens=len(plan.prompt_ids), completion_tokens=len(ids), rid=rid,
                            sampling_masks=masks)
    return result, family.parse_completion(text).to_message(f"call_{rid}")


def episode(tokenizer: Any, turns: int, k: int | None, seed: int = 0) -> LinearTrajectory:
    family = get_family("qwen3", tokenizer)
    rng = np.random.default_rng(seed)
    traj = LinearTrajectory(family)
    tools = tool_schemas(1)
    name = tools[0]["function"]["name"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look up the keys one by one."}]
    for i in range(turns):
        plan = traj.prepare(messages, tools)
        words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40))
        calls = ((name, json.dumps({"key": WORDS[i % len(WORDS)]})),) if i + 1 < turns else ()
        result, reply = engine_reply(family, plan, words, calls, f"r{i}", k, rng)
        traj.commit(plan, result, reply)
        messages = [*traj.messages]
        if calls:
            messages.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": words[:80]})
    return traj


def measure(tokenizer: Any, turns: int) -> Figures:
    figures = Figures()
    plain = episode(tokenizer, turns, None)
    base = build_merged_sample(plain)
    sampled = int(base.loss_mask.sum())
    base_json = len(json.dumps(samples_to_json([base])))
    base_st = len(samples_to_safetensors([base]))
    figures.add("sampled_tokens", sampled, "tokens")
    figures.add("tokens", len(base.tokens), "tokens")
    for k in TOP_KS:
        traj = episode(tokenizer, turns, k)
        sample = build_merged_sample(traj)
        figures.add(f"top{k}_safetensors_bytes_per_sampled_token",
                    (len(samples_to_safetensors([sample])) - base_st) / sampled, "B", better="lower")
        figures.add(f"top{k}_json_bytes_per_sampled_token",
                    (len(json.dumps(samples_to_json([sample]))) - base_json) / sampled, "B", better="lower")
        figures.add(f"top{k}_server_bytes_per_sampled_token", (traj.nbytes - plain.nbytes) / sampled, "B",
                    better="lower")
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizers", type=Path, default=Path(".cache/tokenizers"))
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizers / "qwen3")
    print_figures(measure(tokenizer, args.turns), "bench_sampling_masks", {"turns": args.turns, "top_ks": TOP_KS},
                  args.json)


if __name__ == "__main__":
    main()
