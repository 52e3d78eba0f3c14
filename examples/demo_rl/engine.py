"""How the demo launches released SGLang: the flags a real GRPO loop needs from the engine, and the real-engine tier's
plugin for SGLang's CPU path (tests/sglang/test_real_grpo_loop.py and test_real_grpo_lora.py launch theirs with
`start_demo_engine` too)."""

from __future__ import annotations

from pathlib import Path

from harness.launchers import SGLANG_CPU_PLUGIN, EngineProcess, start_sglang

# `--dtype float32`: SGLang's "auto" serves a float32 checkpoint in float16 (weights and KV cache), and the trainer's
# fp32 recomputation then differs by ~1e-2 on a trained model's tokens.
# `--disable-overlap-schedule`: with the overlap scheduler a token's results are processed a batch after it was
# computed, so the token at an update's boundary can be recorded under the other version.
# The radix cache stays on: the session server keys it by weight version (`extra_key`, issue 38) and cuts the replies
# running at a push, so no token is sampled on KV of older weights and every step's check holds on every token.
ENGINE_ARGS = ("--dtype", "float32", "--disable-overlap-schedule",
               "--max-running-requests", "16", "--reasoning-parser", "qwen3")


def start_demo_engine(python: Path, checkpoint: Path, *extra_args: str, name: str, log_path: Path,
                      wait: bool = True) -> EngineProcess:
    """Released SGLang (run by `python`, its venv's interpreter) serving `checkpoint` as the demo needs it:
    ENGINE_ARGS and `extra_args` (a LoRA adapter's), the CPU plugin, and one torch thread -- a 2-layer model gains
    nothing from more, and spinning OpenMP threads starve the trainer and the session server on a 2-core machine."""
    return start_sglang(python, checkpoint, *ENGINE_ARGS, *extra_args, plugin_dir=SGLANG_CPU_PLUGIN, name=name,
                        wait=wait, log_path=log_path, env={"OMP_NUM_THREADS": "1"})
