"""`make demo-rl`: a real GRPO loop on the CPU against released SGLang 0.5.23 (docs/trainer.md; `python -m
examples.demo_rl`). One module a part: the task (game), the policy and its warm-up, the rollouts running ahead of the
trainer, the trainer's step and its record, the loop, the table and the plot; __main__ launches and reports."""
