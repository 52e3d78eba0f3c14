"""Micro-benchmark of the pure trajectory core (measured and reported, never asserted).

- TITO `prepare` per turn at 1k, 8k and 32k tokens of history: must stay flat (it tokenizes only the
  appended messages); the full re-render + re-tokenize that TITO avoids is shown for comparison.
- `commit` per turn and bytes per stored token (int32 ids + float32 logprobs + uint8 mask, with slack).
- strict decode of a /generate body carrying a ~1.5 MiB structured routed-experts payload.

    python -m benchmarks.bench_tito --tokenizers .cache/tokenizers
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.benchlib import median_seconds
from trajectory import LinearTrajectory, ModelFamily, decode_generate_response, get_family

ROOT = Path(__file__).resolve().parent.parent

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def body(ids: list[int], text: str = "", routed_experts: Any = None) -> bytes:
    meta = {"id": "bench", "finish_reason": {"type": "stop", "matched": ids[-1]}, "prompt_tokens": 0,
            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": "w0", "e2e_latency": 0.1,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    if routed_experts is not None:
        meta["routed_experts"] = routed_experts
    return msgspec.json.encode({"text": text, "output_ids": ids, "meta_info": meta})


def grow(traj: LinearTrajectory, target: int, tools: Any, commit_times: list[float]) -> None:
    family = traj.family
    k = len(traj.records)
    while traj.num_tokens < target:
        reply = " ".join(WORDS[(k + i) % len(WORDS)] for i in range(200))
        plan = traj.prepare([*traj.messages, {"role": "user", "content": f"Turn {k}: continue the list."}], tools)
        ids = [*family.encode(reply), family.eos_token_id]
        result = decode_generate_response(body(ids, reply), family.vocab_size)
        message = family.parse_completion(reply).to_message(f"call_{k}")
        t0 = time.perf_counter()
        traj.commit(plan, result, message)
        commit_times.append(time.perf_counter() - t0)
        k += 1


def bench_family(family: ModelFamily, repeat: int) -> None:
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "search", "description": "Search.", "parameters": parameters}}]
    traj = LinearTrajectory(family)
    commit_times: list[float] = []
    print(f"\n[{family.name}] history  prepare/turn  (new tokens)  full re-render+tokenize  bytes/token")
    for target in (1_000, 8_000, 32_000):
        grow(traj, target, tools, commit_times)
        request = [*traj.messages, {"role": "user", "content": "One more short question, please?"}]
        prepare = median_seconds(lambda request=request: traj.prepare(request, tools), repeat)
        plan = traj.prepare(request, tools)
        full = median_seconds(lambda request=request: family.encode(family.render(request, tools, True)), 10)
        print(f"  {traj.num_tokens:>7} tok  {prepare * 1e6:>9.0f} us  ({plan.num_new_tokens:>3} new)"
              f"  {full * 1e3:>15.2f} ms  {traj.nbytes / traj.num_tokens:>10.2f}")
    print(f"  commit/turn: median {statistics.median(commit_times) * 1e6:.0f} us over {len(commit_times)} turns")


def bench_decode(vocab_size: int, repeat: int) -> None:
    experts = [[[(i * j + k) % 128 for k in range(8)] for j in range(48)] for i in range(1220)]
    for n in (1, 100, 1000):
        payload = body(list(range(1, n + 1)), "x" * n, experts)
        took = median_seconds(lambda payload=payload: decode_generate_response(payload, vocab_size), repeat)
        print(f"  decode {len(payload) / 2**20:.2f} MiB body, {n:>4} completion tokens: {took * 1e3:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizers", type=Path, default=ROOT / ".cache" / "tokenizers")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    for name in ("qwen3", "deepseek"):
        bench_family(get_family(name, AutoTokenizer.from_pretrained(args.tokenizers / name)), args.repeat)
    print("\n[engine output]")
    bench_decode(200_000, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
