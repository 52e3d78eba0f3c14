"""`make demo-rl`: a real GRPO loop on the CPU, end to end, against released SGLang 0.5.23.

What runs, in one process plus two children (the engine from its own venv, the session server):

1. a policy that can learn in minutes: the tiny random Qwen3 checkpoint (`make test-sglang` builds it), its tied
   embedding cut down to the task's alphabet (every other row exactly 0, so every other token has logit exactly 0:
   the full softmax over the 151k vocabulary stays exact and cheap, rollout.grpo.sampled_log_probs), warmed up with a
   few hundred plain-torch supervised steps on the task while the engine starts;
2. the task, multi-turn with a tool and a verifiable reward (`WeatherGame`): the user asks what to wear; the model
   may call `weather` (a tool the policy learned in its warm-up: it is not declared in the prompt, which keeps
   prompts short), reads today's weather (drawn per prompt: sun, rain, snow or cloud) and answers with one word; the
   reward is 1 when the word is the item for that weather (hat, coat, ski, shirt), 0 otherwise. The warm-up teaches
   the format, the call and the mapping, and shows both ways to answer, calling first in only 10% of its
   demonstrations of the choice: the starting policy mostly guesses (right one time in four) and earns ~0.3, and
   what RL finds is that looking the weather up pays;
3. G episodes per prompt through the session server, with the official `openai` client against each session's URL
   (rollout.episodes), running ahead of the trainer (`--ahead-groups` beyond a step's): the next step's episodes run
   while the trainer trains, and when it pushes its weights (rollout.weight_push: `/admin/pause` in_place, SGLang's
   `/update_weights_from_disk` with a `weight_version` and no abort, `/admin/continue`) the replies in flight go on
   under the new weights (partial rollouts) and no turn is lost;
4. every step the trainer checks the samples (rollout.logprob_check: each sampled token recomputed with the weights
   of the version that sampled it), bounds staleness at collection (`--max-staleness`: a group with a token sampled
   more than that many versions ago is dropped, and counted), computes group-relative advantages and takes clipped
   policy-gradient steps with truncated importance sampling against the rollout logprobs (rollout.grpo) on the
   alphabet's rows (the layers stay as the warm-up left them: `--body-lr`);
5. a progress bar per step; at the end a table, `metrics.json` and a PNG (reward and tool calls, mismatch and
   staleness per step).

The engine runs without its radix cache: a prefix cached under old weights would be reused under new ones (SGLang
flushes the cache on an update only when nothing runs, and here something always runs), and every token sampled on
that stale KV would differ from what the trainer recomputes. Tokens a reply samples after an update on KV its
earlier tokens computed under the old weights (the straddling replies of partial rollouts) are counted apart.

    python -m examples.demo_rl --sglang-venv .venv-sglang --checkpoints .cache/checkpoints
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.demo_rl.engine import ROOT, start_demo_engine
from examples.demo_rl.game import WeatherGame
from examples.demo_rl.loop import RunConfig, train_loop
from examples.demo_rl.lora import WARMUP_LR, LoraConfig, LoraPolicy, LoraWeights
from examples.demo_rl.plot import plot
from examples.demo_rl.policy import load_policy
from examples.demo_rl.step_record import verdict
from examples.demo_rl.table import table
from examples.demo_rl.truncation import Truncation
from examples.demo_rl.warmup import warm_up
from harness.launchers import RunningProcess, start_session_server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.demo_rl", description=__doc__.split("\n\n")[0])
    p.add_argument("--sglang-venv", type=Path, default=ROOT / ".venv-sglang", help="the real engine's venv")
    p.add_argument("--checkpoints", type=Path, default=ROOT / ".cache" / "checkpoints",
                   help="the tiny checkpoints (scripts/build_tiny_checkpoints.py); qwen3-dense is the start")
    p.add_argument("--steps", type=int, default=RunConfig.steps)
    p.add_argument("--groups-per-step", type=int, default=RunConfig.groups_per_step, help="prompts per step")
    p.add_argument("--group-size", type=int, default=RunConfig.group_size, metavar="G", help="episodes per prompt")
    p.add_argument("--ahead-groups", type=int, default=RunConfig.ahead_groups,
                   help="groups kept running beyond the step being collected (default %(default)s)")
    p.add_argument("--max-staleness", type=int, default=RunConfig.max_staleness)
    p.add_argument("--fork-groups", action="store_true",
                   help="run each group as forks of one session primed with its prompt (rendered once)")
    p.add_argument("--lr", type=float, default=RunConfig.lr,
                   help="the RL learning rate of the alphabet's embedding rows (default %(default)s)")
    p.add_argument("--body-lr", type=float, default=RunConfig.body_lr,
                   help="the RL learning rate of the transformer's layers (default %(default)s: frozen)")
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--warmup-lr", type=float, default=None,
                   help=f"default 3e-3, {WARMUP_LR:g} with --lora (examples/demo_rl/lora.py says why)")
    p.add_argument("--warmup-call", type=float, default=0.1,
                   help="how often the warm-up's demonstrations of the choice call the tool (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (default 1: the engine "
                   "and the session server need the other core)")
    p.add_argument("--top-k", type=int, default=0, help="sample with this top-k, record the sampling masks and "
                   "train with support-normalised ratios (examples/demo_rl/truncation.py; default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --top-k, also this top-p (default %(default)s)")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter on o_proj instead of the alphabet's rows, "
                   "a revision pushed per step, sessions pinned to one (examples/demo_rl/lora.py)")
    p.add_argument("--lora-rank", type=int, default=LoraConfig.rank)
    p.add_argument("--lora-lr", type=float, default=LoraConfig.lr, help="with --lora (default %(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "demo-rl")
    return p.parse_args(argv)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        truncation = Truncation(top_k=args.top_k, top_p=args.top_p)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.lora and args.body_lr:
        print("error: with --lora the layers stay frozen (--body-lr 0): the adapter is what trains", file=sys.stderr)
        return 2
    # A SIGTERM unwinds like Ctrl-C, so the engine and the session server are stopped on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    torch.set_num_threads(args.threads)
    python = args.sglang_venv.resolve() / "bin" / "python"
    checkpoint = (args.checkpoints / "qwen3-dense").resolve()
    if not python.exists() or not (checkpoint / "config.json").exists():
        print(f"error: need {python} and {checkpoint}: `make demo-rl` builds both (as `make test-sglang` does)",
              file=sys.stderr)
        return 2
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    started = time.perf_counter()
    out: Path = args.out
    logs = out / "logs"
    config = RunConfig(steps=args.steps, groups_per_step=args.groups_per_step, group_size=args.group_size,
                       ahead_groups=args.ahead_groups, max_staleness=args.max_staleness, lr=args.lr,
                       body_lr=args.body_lr, seed=args.seed, fork_groups=args.fork_groups,
                       truncation=truncation,
                       lora=LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, lr=args.lora_lr)
                       if args.lora else None)
    lora_weights = LoraWeights(config.lora, checkpoint, args.seed) if config.lora is not None else None
    lora_engine_args = (config.lora.engine_args(lora_weights.save(out / "weights" / "adapter" / "r0"))
                        if config.lora is not None and lora_weights is not None else ())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    game = WeatherGame(tokenizer)
    # The engine starts (30-60 s of mostly its own imports) while the policy warms up.
    engine = start_demo_engine(python, checkpoint, *lora_engine_args, name="sglang", wait=False,
                               log_path=logs / "sglang.log")
    server: RunningProcess | None = None
    try:
        policy = load_policy(checkpoint, game, args.seed)
        warm = time.perf_counter()
        warmup_lr = args.warmup_lr if args.warmup_lr is not None else WARMUP_LR if args.lora else 3e-3
        losses = warm_up(policy, game, steps=args.warmup_steps, batch=16, lr=warmup_lr,
                         p_call=args.warmup_call, rng=random.Random(args.seed))
        warm_seconds = time.perf_counter() - warm
        print(f"warm-up: {args.warmup_steps} steps in {warm_seconds:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.3f}")
        if lora_weights is not None:
            policy = LoraPolicy(policy, lora_weights)
        engine.wait_ready()
        print(f"engine ready after {time.perf_counter() - started:.0f} s (logs in {logs})")
        server = start_session_server(engine.url, checkpoint, "qwen3", *truncation.server_args(),
                                      *(LoraConfig.server_args() if lora_weights is not None else ()), log_dir=logs)
        steps_log = out / "steps.jsonl"
        steps_log.unlink(missing_ok=True)
        result = asyncio.run(train_loop(config, game, policy, engine_url=engine.url, server_url=server.url,
                                        weights_dir=out / "weights", log=steps_log))
    finally:
        if server is not None:
            server.stop()
        engine.stop()
    wall = time.perf_counter() - started
    records = result.records
    print(table(records))
    first, last = records[0].reward_mean, float(np.mean([r.reward_mean for r in records[-3:]]))
    summary = {
        "wall_seconds": round(wall, 1), "warmup_seconds": round(warm_seconds, 1), "steps": len(records),
        "reward_first_step": first, "reward_last_3_steps": round(last, 3),
        "lookup_rate_first_step": records[0].lookup_rate,
        "lookup_rate_last_3_steps": round(float(np.mean([r.lookup_rate for r in records[-3:]])), 3),
        "episodes": sum(r.episodes for r in records), "failed_episodes": sum(r.failed_episodes for r in records),
        "dropped_groups": sum(r.dropped_groups for r in records),
        "tokens_by_staleness": {k: sum(r.tokens_by_staleness.get(k, 0) for r in records)
                                for k in sorted({k for r in records for k in r.tokens_by_staleness})},
        "straddled_tokens": sum(r.straddled_tokens for r in records),
        "straddled_replies": sum(r.straddled_replies for r in records),
        "cache_hit_rate_per_step": [round(r.cache_hit_rate, 3) for r in records],
        "steps_check_ok": sum(r.check_ok for r in records),
        "steps_check_ok_on_one_version_replies": sum(verdict(r) in ("ok", "ok*") for r in records),
        "worst_clean_mismatch": float(np.nanmax([r.mismatch_max_clean for r in records])),
        **({"sampling": truncation.sampling(),
            "worst_support_mismatch": float(np.nanmax([r.support_mismatch_max for r in records])),
            "worst_unmasked_mismatch": float(np.nanmax([r.unmasked_mismatch_max for r in records]))}
           if truncation.on else {}),
        **({"lora": asdict(config.lora),
            "episodes_across_revisions": sum(r.episodes_across_revisions for r in records)}
           if config.lora is not None else {}),
        "engine_versions": result.versions, "groups_cancelled_at_the_end": result.cancelled_groups,
    }
    png = plot(records, out / "demo_rl.png",
               f"GRPO on released SGLang 0.5.23 (CPU): {len(records)} steps, "
               f"{config.groups_per_step}x{config.group_size} episodes each, wall {wall:.0f} s")
    (out / "metrics.json").write_text(json.dumps({"summary": summary, "config": asdict(config),
                                                  "steps": [asdict(r) for r in records]}, indent=1) + "\n")
    width = max(map(len, summary))
    for key, value in summary.items():
        if key != "engine_versions":
            print(f"{key:<{width}}  {value}")
    print(f"plot: {png}\nmetrics: {out / 'metrics.json'}")
    return 0 if summary["failed_episodes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
