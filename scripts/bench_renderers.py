"""PrimeIntellect's `renderers` as a family backend, measured against ours (exactness and time per turn).

For each family both cover, a tool loop is played turn by turn through our `LinearTrajectory` (the emulated
engine's reply format, tests/support/tito.py's rules), and at every turn the same step is asked of `renderers`:
`bridge_to_next_turn(previous prompt, previous completion, appended messages)`, its incremental rule, falling back
to its full `render_ids` when it declines to bridge (it does after a new user query when thinking is on). Reported
per family: turns where its ids equal ours, turns where it bridged, and the median and mean time per turn of each
step (ours: `prepare`, which also matches the request against the stored history; theirs: bridge or full render),
over histories growing to about 1k and 8k tokens.

    python -m scripts.bench_renderers --tokenizers .cache/tokenizers
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

from trajectory import LinearTrajectory, get_family

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"}}, "required": ["key"]}}}]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _configs() -> dict[str, Any]:
    from renderers.configs import Qwen35RendererConfig, Qwen36RendererConfig

    return {"qwen3.5": Qwen35RendererConfig(), "qwen3.6": Qwen36RendererConfig()}


def play(name: str, tokenizer: Any, history_tokens: int) -> dict[str, Any]:
    import renderers

    sys.path.insert(0, str(ROOT / "tests"))
    from support.tito import Reply, generate

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
        result, reply = generate(family, plan, Reply(words, f"step {k}", calls), rid=f"r{k}")
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
