"""`make demo-gui`: GUI-agent episodes on the toy desktop, screenshots through the session server, samples out.

Starts `sglang-sim` and `session-server` on free loopback ports (as `make demo` does), runs `--episodes` episodes (Chat
Completions, Responses and Anthropic Messages in turn with the default `--api all`), prints each episode's reward and,
per sample, where its images' placeholder ids sit, writes the samples and the first episode's screenshots under `--out`,
and stops both processes. Against the emulated engine each observation carries the desktop expert's next action as a sim
directive, so every episode must reach reward 1; against a real engine (`--engine-url`) they are left out.

    python -m examples.gui_agent --tokenizers .cache/tokenizers
    python -m examples.gui_agent --engine-url http://127.0.0.1:30000 --tokenizer DIR --model-family qwen3-vl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from examples.gui_agent.agent import Api, GuiConfig, GuiEpisode, pad_runs, run_gui_episodes
from harness.launchers import LOOPBACK, ProcessCrashed, RunningProcess, free_port, start_session_server, start_sim
from rollout.client import SessionClient
from trajectory import Sample, samples_to_json, samples_to_safetensors

ROOT = Path(__file__).resolve().parents[2]
IMAGE_PAD = "<|image_pad|>"
TEXT_TOKENIZER = {"qwen3-vl": "qwen3"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.gui_agent", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--episodes", type=int, default=8, help="number of episodes (default 8)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes in flight at once (default 4)")
    p.add_argument("--api", choices=("chat", "responses", "messages", "all"), default="all",
                   help="Chat Completions or Responses (openai SDK), Anthropic Messages (anthropic SDK),\n"
                        "or all three in turn (default)")
    p.add_argument("--observation", choices=("image", "text"), default="image",
                   help="screenshots (default), or the screen described in text for a text-only model")
    p.add_argument("--model-family", default="qwen3-vl", metavar="NAME", help="model family (default %(default)s)")
    p.add_argument("--tokenizers", type=Path, default=ROOT / ".cache" / "tokenizers",
                   help="directory with one tokenizer directory per family (`make tokenizers` builds it)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory of the served model (default: TOKENIZERS/MODEL_FAMILY)")
    p.add_argument("--engine-url", default=None,
                   help="a real SGLang server instead of the emulated engine (observations then carry no directives)")
    p.add_argument("--model", default="default", help="model name sent in requests (default 'default')")
    p.add_argument("--max-turns", type=int, default=12, help="turn limit per episode (default 12)")
    p.add_argument("--max-tokens", type=int, default=256, help="max tokens per reply (default 256)")
    p.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                   help="'required': every reply must call a tool (an untrained model on a real engine still acts)")
    p.add_argument("--no-thinking", dest="thinking", action="store_const", const=False, default=None,
                   help="turn the family's thinking switch off (Qwen3 reasons before it answers by default)")
    p.add_argument("--seed", type=int, default=0, help="the first episode's desktop seed; episode i gets seed+i")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "gui",
                   help="output folder (default out/gui/): samples.jsonl, episodes.jsonl, frames/ of episode 0")
    return p.parse_args(argv)


@contextlib.contextmanager
def services(args: argparse.Namespace, tokenizer: Path, log_dir: Path) -> Iterator[str]:
    """The engine (unless --engine-url) and the session server, started at once; stopped in reverse order."""
    started: list[RunningProcess] = []
    try:
        engine_url = args.engine_url
        if engine_url is None:
            port = free_port()
            started.append(start_sim(tokenizer, args.model_family, "--port", str(port), log_dir=log_dir, wait=False))
            engine_url = f"http://{LOOPBACK}:{port}"
        started.append(start_session_server(engine_url, tokenizer, args.model_family, log_dir=log_dir, wait=False))
        for proc in started:
            proc.wait_ready()
            print(f"{proc.name:<20} {proc.url}")
        yield started[-1].url
    finally:
        for proc in reversed(started):
            code = proc.stop()
            how = "killed after the SIGTERM grace period" if proc.killed else "stopped on SIGTERM"
            print(f"{how}: {proc.name} (exit code {code})")


def default_tokenizer(tokenizers: Path, family: str) -> Path:
    """TOKENIZERS/FAMILY; a vision family without a directory of its own uses its text family's (the tiny Qwen3-VL
    carries Qwen3's tokenizer, whose vocabulary has the image markers)."""
    own = tokenizers / family
    if (own / "tokenizer_config.json").exists() or family not in TEXT_TOKENIZER:
        return own
    return tokenizers / TEXT_TOKENIZER[family]


def image_pad_id(tokenizer: Path) -> int | None:
    """The id of the image placeholder token in the served tokenizer; None when it has none (a text-only model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    return int(pad) if isinstance(pad, int) and pad != tok.unk_token_id else None


def image_spans(sample: Sample, pad_id: int | None) -> tuple[list[dict[str, Any]], bool]:
    """The sample's own image records (span, hash, grid: `metadata["images"]`) and whether their spans are exactly
    the runs of image pads in its tokens (read from the ids, trusting nothing)."""
    records = list(sample.metadata.get("images") or [])
    runs = pad_runs(sample.tokens.tolist(), pad_id) if pad_id is not None else []
    return records, [r["span"] for r in records] == [[start, start + n] for start, n in runs]


def payload_bytes(sample: Sample, images: str = "bytes") -> int:
    """The sample's safetensors size as the server sends it with its images as `images`: "bytes" (the PNGs the agent
    sent, rollout's default: the client computed the pixel values) or "pixels" (the server's pixel values)."""
    if images == "bytes":
        sample = dataclasses.replace(sample, pixel_values=None, image_grid_thw=None)
    else:
        sample = dataclasses.replace(sample, image_bytes=None, image_byte_offsets=None)
    return len(samples_to_safetensors([sample]))


def episode_lines(result: GuiEpisode, pad_id: int | None) -> list[str]:
    """One line for the episode; per sample its sizes, then its images' spans [start, end) in the token ids with
    each image's content hash and grid."""
    head = (f"episode {result.index:>3}  seed {result.seed:>4}  {result.api:<9}  word {result.word!r:<10} "
            f"reward {result.reward:.1f}  turns {result.turns:>2}  actions {result.actions:>2}  "
            f"screenshots {result.screenshots:>2}  {result.stop_reason}")
    lines = [head + (f"  ERROR {result.error}" if result.error else "")]
    for k, sample in enumerate(result.samples):
        records, agree = image_spans(sample, pad_id)
        pixels = sample.pixel_values
        shape = "" if pixels is None else f" {'x'.join(map(str, pixels.shape))} {pixels.dtype}"
        lines.append(f"    sample {k}: {len(sample.tokens)} tokens, {int(sample.loss_mask.sum())} sampled, "
                     f"{len(records)} images, payload {payload_bytes(sample) / 2**10:.1f} KiB "
                     f"({payload_bytes(sample, 'pixels') / 2**20:.1f} MiB with pixel_values{shape})"
                     + ("" if agree else "  MISMATCH: the image records are not the pad runs of the tokens"))
        if records:
            lines.append("      spans " + ", ".join(
                f"[{r['span'][0]}, {r['span'][1]}) {r['digest'][7:15]} {'x'.join(map(str, r['image_grid_thw']))}"
                for r in records))
    return lines


def summarize(results: list[GuiEpisode], pad_id: int | None, seconds: float) -> dict[str, Any]:
    samples = [s for r in results for s in r.samples]
    image_tokens = sum(n for s in samples for _, n in (pad_runs(s.tokens.tolist(), pad_id) if pad_id else []))
    return {
        "episodes": len(results),
        "errors": sum(not r.ok for r in results),
        "reward 1.0": sum(r.reward == 1.0 for r in results),
        "mean reward": round(sum(r.reward for r in results) / max(1, len(results)), 3),
        "turns": sum(r.turns for r in results),
        "actions": sum(r.actions for r in results),
        "screenshots": sum(r.screenshots for r in results),
        "samples": len(samples),
        "images in samples": sum(len(s.metadata.get("images") or []) for s in samples),
        "spans off the pad runs": sum(not image_spans(s, pad_id)[1] for s in samples),
        "tokens": sum(len(s.tokens) for s in samples),
        "sampled tokens": sum(int(s.loss_mask.sum()) for s in samples),
        "image placeholder tokens": image_tokens,
        "payload KiB": round(sum(payload_bytes(s) for s in samples) / 2**10, 1),
        "payload MiB with pixel values": round(sum(payload_bytes(s, "pixels") for s in samples) / 2**20, 1),
        "seconds": round(seconds, 2),
    }


def write_outputs(out: Path, results: list[GuiEpisode]) -> list[Path]:
    """samples.jsonl (one sample a line, image records in its metadata, without the pixel values: frames/ and each
    record's grid rebuild them), episodes.jsonl (what each action did), frames/ (episode 0's screens)."""
    out.mkdir(parents=True, exist_ok=True)
    samples_path, episodes_path, frames = out / "samples.jsonl", out / "episodes.jsonl", out / "frames"
    with samples_path.open("w") as f:
        for r in results:
            for line in samples_to_json(r.samples):  # the pixel values (megabytes) stay in the payload
                line = {k: v for k, v in line.items()
                        if k not in ("pixel_values", "image_grid_thw", "image_bytes", "image_byte_offsets")}
                f.write(json.dumps({"episode": r.index, "seed": r.seed, **line}) + "\n")
    with episodes_path.open("w") as f:
        for r in results:
            f.write(json.dumps({"episode": r.index, "seed": r.seed, "api": r.api, "word": r.word, "reward": r.reward,
                                "turns": r.turns, "actions": r.actions, "stop_reason": r.stop_reason,
                                "final_answer": r.final_answer, "events": r.events, "error": r.error}) + "\n")
    written = [samples_path, episodes_path]
    if results and results[0].frames:
        frames.mkdir(exist_ok=True)
        for old in frames.glob("*.png"):
            old.unlink()
        for i, png in enumerate(results[0].frames):
            (frames / f"{i:02d}.png").write_bytes(png)
        written.append(frames)
    return written


async def run(args: argparse.Namespace, server_url: str) -> tuple[list[GuiEpisode], float]:
    seeds = [args.seed + i for i in range(args.episodes)]
    apis: list[Api] = ["chat", "responses", "messages"] if args.api == "all" else [args.api]
    configs = [GuiConfig(api=apis[i % len(apis)], observation=args.observation, scripted=args.engine_url is None,
                         model=args.model, max_turns=args.max_turns, max_tokens=args.max_tokens, keep_frames=i == 0,
                         tool_choice=args.tool_choice, thinking=args.thinking)
               for i in range(args.episodes)]
    async with SessionClient(server_url) as client:
        await client.health()
        started = time.perf_counter()
        results = await run_gui_episodes(client, seeds, concurrency=args.concurrency, config=configs)
        elapsed = time.perf_counter() - started
    return results, elapsed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = args.tokenizer or default_tokenizer(args.tokenizers, args.model_family)
    if not (tokenizer / "tokenizer_config.json").exists():
        print(f"error: no tokenizer in {tokenizer} (run `make tokenizers`, or pass --tokenizer DIR)", file=sys.stderr)
        return 2
    if args.episodes < 1 or args.concurrency < 1:
        print("error: --episodes and --concurrency must be >= 1", file=sys.stderr)
        return 2
    pad_id = image_pad_id(tokenizer)
    try:
        with services(args, tokenizer, args.out / "logs") as server_url:
            results, elapsed = asyncio.run(run(args, server_url))
    except (ProcessCrashed, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for r in results:
        print("\n".join(episode_lines(r, pad_id)))
    summary = summarize(results, pad_id, elapsed)
    width = max(map(len, summary))
    print("-" * (width + 14))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value:>11}")
    print("-" * (width + 14))
    written = write_outputs(args.out, results)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("wrote " + ", ".join(str(p.relative_to(Path.cwd()) if p.is_relative_to(Path.cwd()) else p) for p in written))
    failed = [r for r in results if not r.ok]
    short = [r for r in results if r.ok and r.reward < 1.0] if args.engine_url is None else []
    for r in failed[:5]:
        print(f"episode {r.index} failed: {r.error}", file=sys.stderr)
    for r in short[:5]:
        print(f"episode {r.index} (scripted) ended with reward {r.reward}: {r.events[-1:]}", file=sys.stderr)
    off = summary["spans off the pad runs"]
    if off:
        print(f"{off} samples' image records disagree with their tokens' pad runs", file=sys.stderr)
    return 1 if failed or short or off else 0


if __name__ == "__main__":
    sys.exit(main())
