"""Measure sglang-sim's own throughput at zero token latency (requests/s and generated tokens/s).

Starts a real `sglang-sim` process, drives it with concurrent httpx clients over loopback, and reports wall-clock
rates plus the engine process's CPU seconds (so the figure is not just the load generator's limit).

    python -m benchmarks.bench_sim --tokenizer .cache/tokenizers/qwen3 --family qwen3 --requests 3000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import msgspec

from benchmarks.benchlib import proc_cpu_seconds
from harness.launchers import start_sim
from sglang_sim import directives


class _Meta(msgspec.Struct):
    completion_tokens: int


class _Reply(msgspec.Struct):
    meta_info: _Meta


async def _drive(url: str, n: int, concurrency: int, prompt: list[int], max_new: int, logprobs: bool,
                 experts: bool) -> int:
    tokens = 0
    next_i = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, next_i
        while next_i < n:
            i = next_i
            next_i += 1
            body = {"input_ids": [*prompt, 100 + i % 1000], "return_logprob": logprobs,
                    "return_routed_experts": experts, "sampling_params": {"max_new_tokens": max_new}}
            r = await client.post("/generate", json=body)
            r.raise_for_status()
            tokens += msgspec.json.decode(r.content, type=_Reply).meta_info.completion_tokens

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".cache/tokenizers/qwen3")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=256, help="scripted reply length (capped by max-new-tokens)")
    p.add_argument("--no-logprobs", action="store_true")
    p.add_argument("--routed-experts-bytes", type=int, default=0, help="ask for a routed-experts payload this big")
    args = p.parse_args()

    sim = start_sim(args.tokenizer, args.family, "--kv-capacity-tokens", "400000",
                    "--routed-experts-bytes", str(args.routed_experts_bytes))
    url = sim.url
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        head = tok.encode(f"{directives.tokens(args.reply_tokens)} ", add_special_tokens=False)
        prompt = (head + [11] * args.prompt_tokens)[: args.prompt_tokens]
        experts = args.routed_experts_bytes > 0
        asyncio.run(_drive(url, 100, args.concurrency, prompt, args.max_new_tokens, not args.no_logprobs,
                           experts))  # warm-up
        cpu0, t0 = proc_cpu_seconds(sim.pid), time.perf_counter()
        tokens = asyncio.run(_drive(url, args.requests, args.concurrency, prompt, args.max_new_tokens,
                                    not args.no_logprobs, experts))
        wall, cpu = time.perf_counter() - t0, proc_cpu_seconds(sim.pid) - cpu0
        print(f"requests={args.requests} concurrency={args.concurrency} prompt={args.prompt_tokens} "
              f"max_new_tokens={args.max_new_tokens} logprobs={not args.no_logprobs} "
              f"routed_experts_bytes={args.routed_experts_bytes}")
        print(f"wall: {args.requests / wall:.0f} req/s, {tokens / wall:.0f} generated tok/s ({wall:.2f} s)")
        print(f"engine CPU: {cpu:.2f} s -> {args.requests / cpu:.0f} req/CPU-s, {tokens / cpu:.0f} tok/CPU-s")
    finally:
        sim.stop()


if __name__ == "__main__":
    main()
