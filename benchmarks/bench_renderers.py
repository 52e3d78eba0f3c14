"""PrimeIntellect's `renderers` as a family backend, measured against ours (exactness and time per turn).

For each family both cover, a tool loop is played turn by turn through our `LinearTrajectory` (each reply in the
emulated engine's format: the family's formatted completion, tokenized, then its stop token), and at every turn the
same step is asked of `renderers`: `bridge_to_next_turn(previous prompt, previous completion, appended messages)`,
its incremental rule, falling back to its full `render_ids` when it declines to bridge (it does after a new user
query when thinking is on). Reported per family: turns where its ids equal ours, turns where it bridged, and the
median and mean time per turn of each step (ours: `prepare`, which also matches the request against the stored
history; theirs: bridge or full render), over histories growing to about 1k and 8k tokens.

    python -m benchmarks.bench_renderers --tokenizers .cache/tokenizers
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from trajectory import GenerateResult, LinearTrajectory, ModelFamily, TurnPlan, decode_generate_response, get_family

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"}}, "required": ["key"]}}}]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _configs() -> dict[str, Any]:
    from renderers.configs import Qwen35RendererConfig, Qwen36RendererConfig

    return {"qwen3.5": Qwen35RendererConfig(), "qwen3.6": Qwen36RendererConfig()}


def engine_reply(family: ModelFamily, plan: TurnPlan, content: str, reasoning: str, calls: tuple[tuple[str, str], ...],
                 rid: str) -> tuple[GenerateResult, dict[str, Any]]:
    """One engine call for `plan` as the emulated engine answers it: the family's formatted completion, tokenized,
    then the stop token the family writes after it, in a native /generate body through the strict decoder; returns
    the result and the reply message the agent sends back. A prompt that opened the reply (Qwen3.5's `<think>\n`)
    is continued, not opened again."""
    opened = family.opened_reply(plan.prompt_ids)
    text = family.format_completion(content, reasoning, list(calls)).removeprefix(opened)
    ids = family.encode(text)
    stop = family.stop_token_after(text)
    ids.append(stop)
    body = {"text": text, "output_ids": ids, "meta_info": {
        "id": rid, "finish_reason": {"type": "stop", "matched": stop}, "prompt_tokens": len(plan.prompt_ids),
        "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": "w0", "e2e_latency": 0.01,
        "output_token_logprobs": [[-0.25, t, None] for t in ids]}}
    result = decode_generate_response(json.dumps(body).encode(), family.vocab_size)
    return result, family.parse_completion(opened + text).to_message(f"call_{rid}")


def play(name: str, tokenizer: Any, history_tokens: int) -> dict[str, Any]:
    import renderers

    family = get_family(name, tokenizer)
    oracle = renderers.create_renderer(tokenizer, _configs()[name])
    traj = LinearTrajectory(family)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the tools."},
                                      {"role": "user", "content": "Start."}]
    ours, theirs, equal, bridged, turns = [], [], 0, 0, 0
    previous: tuple[list[int], list[int]] | None = None
    appended: list[dict[str, Any]] = []
    k = 0
    while traj.num_tokens < history_tokens:
        t0 = time.perf_counter()
        plan = traj.prepare(messages, TOOLS)
        ours.append(time.perf_counter() - t0)
        if previous is not None:
            t0 = time.perf_counter()
            out = oracle.bridge_to_next_turn(*previous, appended, tools=TOOLS)
            ids = out.token_ids if out is not None else oracle.render_ids(messages, tools=TOOLS,
                                                                           add_generation_prompt=True)
            theirs.append(time.perf_counter() - t0)
            turns += 1
            bridged += out is not None
            equal += ids == plan.prompt_ids.tolist()
        words = " ".join(WORDS[(k + i) % len(WORDS)] for i in range(120))
        calls = (("lookup", json.dumps({"key": f"k{k}", "n": k})),) if k % 3 != 2 else ()
        result, reply = engine_reply(family, plan, words, f"step {k}", calls, rid=f"r{k}")
        traj.commit(plan, result, reply)
        previous = (plan.prompt_ids.tolist(), result.output_ids.tolist())
        appended = ([{"role": "tool", "tool_call_id": f"call_r{k}_0", "content": f"value {k}"}] if calls
                    else [{"role": "user", "content": f"Go on ({k})."}])
        messages = [*messages, reply, *appended]
        k += 1
    return {"turns": turns, "equal": equal, "bridged": bridged,
            "ours_ms": 1e3 * statistics.median(ours[1:]), "theirs_ms": 1e3 * statistics.median(theirs),
            "ours_mean": 1e3 * statistics.mean(ours[1:]), "theirs_mean": 1e3 * statistics.mean(theirs),
            "tokens": traj.num_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizers", type=Path, default=ROOT / ".cache" / "tokenizers")
    args = parser.parse_args(argv)
    print("family   history  turns  ids equal  bridged  ours/turn median (mean)  renderers/turn median (mean)")
    for name in _configs():
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizers / name)
        for target in (1_000, 8_000):
            r = play(name, tokenizer, target)
            print(f"{name:8} {r['tokens']:7d}  {r['turns']:5d}  {r['equal']:9d}  {r['bridged']:7d}  "
                  f"{r['ours_ms']:6.2f} ms ({r['ours_mean']:5.2f})     "
                  f"{r['theirs_ms']:9.2f} ms ({r['theirs_mean']:6.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
