"""What images cost in samples: bytes per sample with the pixel values (`{"images": "pixels"}`, the server's default)
and with the agent's files (`{"images": "bytes"}`, rollout's default), JSON and safetensors.

A GUI-agent episode (examples/gui_agent's desktop, solved by its expert: one 320x240 screenshot per turn) is played
through `LinearTrajectory` on the qwen3-vl family; its merged sample is encoded in both image forms, exactly as
POST /sessions/{id}/samples builds them (trajectory/image_pixels.py). The pixel values computed on the trainer's side
from the files are checked equal to the server's, and the time that takes is reported beside the sizes (the only
timing; the sizes are exact counts and do not depend on the machine).

    python -m benchmarks.bench_image_samples --tokenizers .cache/tokenizers [--screenshots 3] [--json report.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from benchmarks.benchlib import Figures, print_figures
from examples.gui_agent.desktop import expert_action, new_desktop, screenshot_png, step
from trajectory import (
    GenerateResult,
    LinearTrajectory,
    Sample,
    build_merged_sample,
    samples_to_json,
    samples_to_safetensors,
)
from trajectory.families.qwen3_vl import Qwen3VLFamily
from trajectory.image_grid import QWEN3_VL
from trajectory.image_pixels import with_image_bytes, with_image_pixels, with_pixel_values
from trajectory.images import Image, image_digest


def screenshots(count: int, seed: int = 0) -> list[bytes]:
    """`count` screens of one desktop task as its expert solves it (the last one repeated once it is solved)."""
    desktop, out = new_desktop(seed), []
    for _ in range(count):
        out.append(screenshot_png(desktop))
        action = expert_action(desktop)
        if action is not None:
            desktop = step(desktop, action)
    return out


def episode(tokenizer: Any, files: list[bytes]) -> tuple[Sample, dict[str, Image]]:
    """One turn per screenshot (a short reply each), the merged sample and the session's images."""
    family = Qwen3VLFamily(tokenizer)
    traj = LinearTrajectory(family)
    history: list[dict[str, Any]] = []
    for k, data in enumerate(files):
        image = Image(image_digest(data), data, 320, 240, "image/png")
        history.append({"role": "user", "content": [{"type": "text", "text": f"Screen {k}: act."},
                                                    {"type": "image", "image": image}]})
        plan = traj.prepare(history)
        text = f"click({40 + k}, {60 + k})"
        ids = family.encode(text + "<|im_end|>")
        result = GenerateResult(text=text, output_ids=np.asarray(ids, np.int32),
                                logprobs=np.full(len(ids), -0.5, np.float32),
                                finish_reason={"type": "stop", "matched": ids[-1]},
                                prompt_tokens=len(plan.prompt_ids), completion_tokens=len(ids))
        traj.commit(plan, result, {"role": "assistant", "content": text})
        history.append({"role": "assistant", "content": text})
    return build_merged_sample(traj), dict(traj.images)


def measure(tokenizer: Any, count: int) -> Figures:
    figures = Figures()
    files = screenshots(count)
    sample, images = episode(tokenizer, files)
    pixels, carried = with_image_pixels(sample, images, QWEN3_VL), with_image_bytes(sample, images, QWEN3_VL)
    start = time.perf_counter()
    local = with_pixel_values(carried)
    seconds = time.perf_counter() - start
    if not (local.pixel_values is not None and pixels.pixel_values is not None
            and np.array_equal(local.pixel_values, pixels.pixel_values)):
        raise AssertionError("the pixel values computed from the files differ from the server's")
    figures.add("screenshots", count, "images")
    figures.add("tokens", len(sample.tokens), "tokens")
    figures.add("screenshot_png_bytes", sum(map(len, files)) / count, "B")
    for form, s in (("pixels", pixels), ("bytes", carried)):
        figures.add(f"{form}_safetensors_bytes_per_sample", len(samples_to_safetensors([s])), "B", better="lower")
        figures.add(f"{form}_json_bytes_per_sample", len(json.dumps(samples_to_json([s]))), "B", better="lower")
    figures.add("safetensors_ratio_pixels_to_bytes", figures.values["pixels_safetensors_bytes_per_sample"]
                / figures.values["bytes_safetensors_bytes_per_sample"], "x", better="higher")
    figures.add("trainer_pixel_values_ms_per_image", seconds * 1000 / count, "ms", better="lower")
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizers", type=Path, default=Path(".cache/tokenizers"))
    p.add_argument("--screenshots", type=int, default=3)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizers / "qwen3")
    print_figures(measure(tokenizer, args.screenshots), "bench_image_samples", {"screenshots": args.screenshots},
                  args.json)


if __name__ == "__main__":
    main()
