"""`python -m rollout.view SAMPLES -o page.html`: the server's trajectory view, offline, for a samples file.

SAMPLES is what `POST /sessions/{id}/samples` returns (JSON, or safetensors with `Accept: application/octet-stream`);
the page is one self-contained HTML file (trajectory.view: the same renderer the server's /view/ pages use), one
section per sample. `--tokenizer DIR` decodes the tokens (else the page shows ids); a sample with pixel values shows
its images rebuilt from them at their pad runs. With `--checkpoint DIR` every sampled token's logprob is recomputed
with the policy (`rollout.check_logprobs`, one call per sample) and the page overlays the check: per token the
trainer's logprob and the mismatch, tokens beyond `--atol` outlined, each sample's worst tokens listed and linked to
their place. docs/viewer.md says how to read it.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trajectory import Sample, samples_from_json, samples_from_safetensors
from trajectory.image_grid import QWEN3_VL, ImageGeometry
from trajectory.view import SegmentExtras, build_document, offline_page, piece_table, segment_of_sample

ATOL = 1e-3  # the fp32 bar of docs/design.md 6


def read_samples(path: Path) -> list[Sample]:
    data = path.read_bytes()
    if data.lstrip()[:1] in (b"[", b"{"):
        return samples_from_json(json.loads(data))
    return samples_from_safetensors(data)


def image_pixels(patches: np.ndarray, grid: Sequence[int], geometry: ImageGeometry) -> np.ndarray:
    """The image (uint8 [H, W, 3]) one image's pixel-value rows hold: the Qwen2-VL processor's patch flattening
    (transformers' Qwen2VLImageProcessor) undone, then its normalisation and 1/255 rescale."""
    t, h, w = (int(x) for x in grid)
    m, p, tp = geometry.merge_size, geometry.patch_size, geometry.temporal_patch_size
    x = patches.reshape(t, h // m, w // m, m, m, 3, tp, p, p).transpose(0, 6, 5, 1, 3, 7, 2, 4, 8)
    frame = x.reshape(t * tp, 3, h * p, w * p)[0]
    mean, std = np.asarray(geometry.image_mean)[:, None, None], np.asarray(geometry.image_std)[:, None, None]
    rgb: np.ndarray = np.clip((frame * std + mean) * 255.0 + 0.5, 0, 255).astype(np.uint8).transpose(1, 2, 0)
    return rgb


def image_sources(sample: Sample, geometry: ImageGeometry) -> dict[str, str]:
    """digest -> PNG data URL of each image the sample's pixel values hold."""
    images = sample.metadata.get("images") or []
    if sample.pixel_values is None or sample.image_grid_thw is None or not images:
        return {}
    from PIL import Image

    out, row = {}, 0
    for image, grid in zip(images, sample.image_grid_thw.tolist(), strict=False):
        rows = int(np.prod(grid))
        rgb = image_pixels(np.asarray(sample.pixel_values[row:row + rows], dtype=np.float64), grid, geometry)
        row += rows
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, "PNG")
        out[str(image["digest"])] = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    return out


def check_overlay(sample: Sample, policy: Any, *, temperature: float, atol: float, worst: int) -> dict[str, Any]:
    """check_logprobs on this sample alone: its trainer logprobs (null where not compared), metrics, worst tokens."""
    from rollout.logprob_check import check_logprobs

    report = check_logprobs([sample], policy, temperature=temperature, worst=worst)
    compared = np.zeros(len(sample.tokens), dtype=bool)
    compared[np.flatnonzero(sample.loss_mask)] = True
    compared[0] = False  # position 0 has no context: never scored
    trainer = report.per_sample[0].trainer_log_probs.astype(np.float64)
    return {
        "tolerance": atol,
        "trainer": [round(float(v), 6) if c else None for v, c in zip(trainer, compared, strict=True)],
        "metrics": {k: v for k, v in report.metrics.items() if isinstance(v, int | float)},
        "worst": [{"position": w.position, "token_id": w.token_id, "engine": w.rollout_log_prob,
                   "trainer": w.trainer_log_prob, "diff": w.abs_diff, "turn": w.turn,
                   "weight_version": w.weight_version, "switched": w.switched} for w in report.worst],
        "summary": report.format(),
    }


def load_policy(checkpoint: Path) -> Any:
    """The checkpoint's own architecture (config.json `architectures`: a causal LM or Qwen3-VL), in fp32."""
    import torch
    import transformers

    architecture = json.loads((checkpoint / "config.json").read_text())["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(checkpoint, dtype=torch.float32).eval()


def build_page(samples: Sequence[Sample], *, title: str, tokenizer: Any = None, geometry: ImageGeometry = QWEN3_VL,
               policy: Any = None, temperature: float = 1.0, atol: float = ATOL, worst: int = 10) -> str:
    segments = []
    worst_diff = 0.0
    for i, sample in enumerate(samples):
        check = None
        if policy is not None:
            check = check_overlay(sample, policy, temperature=temperature, atol=atol, worst=worst)
            worst_diff = max(worst_diff, float(check["metrics"].get("rollout_check/logprob_abs_diff_max", 0.0)))
        label = f"sample {i}" + (f" · segment {sample.metadata['segment']}" if "segment" in sample.metadata else "")
        segments.append(segment_of_sample(sample, SegmentExtras(label, image_sources=image_sources(sample, geometry),
                                                                check=check)))
    pieces, special = {}, []
    if tokenizer is not None:
        pieces = piece_table(lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False)),
                             [s.tokens for s in samples])
        special = list(tokenizer.all_special_ids) + [i for i, t in tokenizer.added_tokens_decoder.items() if t.special]
    header: dict[str, Any] = {"samples": len(samples), "tokens": sum(len(s.tokens) for s in samples),
                              "sampled": sum(int(s.loss_mask.sum()) for s in samples)}
    if policy is not None:
        header["trainer check"] = f"max |diff| {worst_diff:.3g} ({'within' if worst_diff <= atol else 'beyond'} {atol})"
    return offline_page(build_document("samples", title, header, segments, pieces, special))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout.view", description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", type=Path, help="a /samples reply: JSON or safetensors")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the HTML file to write")
    parser.add_argument("--tokenizer", type=Path, help="decode the tokens with this tokenizer (default: --checkpoint)")
    parser.add_argument("--checkpoint", type=Path, help="overlay the trainer check with this policy checkpoint")
    parser.add_argument("--temperature", type=float, default=1.0, help="the requests' sampling temperature (0 or 1: "
                        "raw logprobs; see rollout.check_logprobs)")
    parser.add_argument("--atol", type=float, default=ATOL, help="mismatch tolerance (default %(default)s)")
    parser.add_argument("--worst", type=int, default=10, help="worst tokens listed per sample")
    parser.add_argument("--title", help="the page's title (default: the samples file's name)")
    args = parser.parse_args(argv)
    samples = read_samples(args.samples)
    tokenizer_dir = args.tokenizer or args.checkpoint
    tokenizer = geometry = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = tokenizer_dir / "preprocessor_config.json"
        if config.exists():
            geometry = ImageGeometry.from_preprocessor_config(json.loads(config.read_text()))
    policy = load_policy(args.checkpoint) if args.checkpoint is not None else None
    page = build_page(samples, title=args.title or args.samples.name, tokenizer=tokenizer,
                      geometry=geometry or QWEN3_VL, policy=policy, temperature=args.temperature, atol=args.atol,
                      worst=args.worst)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(page, encoding="utf-8")
    print(f"wrote {args.output} ({len(samples)} samples, {len(page) / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
