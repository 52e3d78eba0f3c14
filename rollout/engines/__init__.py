"""Inference engines the session server fronts: `sim`, the emulated SGLang engine (`sglang-sim`).

A real SGLang server is launched with `python -m scripts.launch_sglang` (it needs GPUs and the `sglang` package); the
session server talks to either through the same native HTTP API, so switching is one `--engine-url` away.
"""
