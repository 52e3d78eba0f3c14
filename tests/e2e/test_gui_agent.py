"""The GUI agent example end to end (examples/gui_agent/, docs/gui-agent.md): screenshots of the toy desktop through
real `session-server` and `sglang-sim` processes with the official `openai` (Chat, Responses) and `anthropic` SDKs,
the expert's actions scripted into each observation, every episode reaching reward 1 and coming out as one sample
whose images are placeholder runs of the right length where the prompt put them; and `make demo-gui`'s command.

The image tests need the vision family (qwen3-vl: its tokenizer, the server's image path and the sim's `image_data`);
they are skipped, with that reason, only while those are missing from the tree. The text-observation test runs on any
tree: the same driver, the screen described in words, on the text-only Qwen3.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.gui_agent import desktop as gui
from examples.gui_agent.agent import GuiConfig, GuiEpisode, pad_runs, run_gui_episodes
from rollout.client import SessionClient
from support.stack import Stack, StackFactory, launch_stack
from trajectory import family_names

ROOT = Path(__file__).resolve().parents[2]
VISION = "qwen3-vl"
TEXT = "qwen3"
GRID = (1, 16, 20)  # 320x240 resized to 320x256: a 16x20 grid of 16-pixel patches, one frame
PADS_PER_SCREENSHOT = 80  # the grid's patches 2x2 merged (trajectory/image_grid.py)
SEEDS = [0, 1, 2, 3]


def _missing_vision() -> str | None:
    """Why the image tests cannot run on this tree (None: they run)."""
    if VISION not in family_names():
        return f"no {VISION} model family in trajectory yet (issue 34's image support has not landed)"
    if importlib.util.find_spec("sglang_sim.images") is None:
        return "the emulated engine takes no image_data yet (issue 34's sglang_sim/images.py has not landed)"
    return None


needs_vision = pytest.mark.skipif(_missing_vision() is not None, reason=str(_missing_vision()))


def vision_tokenizers(tokenizer_dirs: dict[str, Path]) -> dict[str, Path]:
    """The vision family's tokenizer: its own directory, else Qwen3's (the tiny Qwen3-VL carries Qwen3's)."""
    return {VISION: tokenizer_dirs.get(VISION, tokenizer_dirs[TEXT])}


@pytest.fixture(scope="module")
def vision(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(vision_tokenizers(tokenizer_dirs), tmp_path_factory.mktemp("gui"), family=VISION) as stack:
        yield stack


def image_pad_id(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return int(tok.convert_tokens_to_ids("<|image_pad|>"))


def run(server: str, seeds: list[int], config: GuiConfig) -> list[GuiEpisode]:
    async def go() -> list[GuiEpisode]:
        async with SessionClient(server) as client:
            return await run_gui_episodes(client, seeds, concurrency=2, config=config)

    return asyncio.run(go())


def replayed_frames(seed: int, events: list[str]) -> list[bytes]:
    """The screenshots an episode of `seed` sends, rebuilt from the desktop alone: the expert's path, one screen
    before each turn (the scripted model takes one action a turn)."""
    d = gui.new_desktop(seed)
    frames = [gui.screenshot_png(d)]
    for _ in events:
        action = gui.expert_action(d)
        assert action is not None
        d = gui.step(d, action)
        frames.append(gui.screenshot_png(d))
    return frames


def assert_solved(result: GuiEpisode) -> None:
    assert result.ok, result.error
    assert result.reward == 1.0 and result.stop_reason == "final_answer", result.events
    assert result.final_answer == f"Done: the note {result.word} is saved."
    assert result.actions == result.turns - 1 == len(result.events)  # one scripted action a turn, then the answer
    assert len(result.samples) == 1  # one segment: every turn extended the stored history


@needs_vision
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_screenshot_episodes_reach_the_goal_and_come_out_with_their_image_spans(vision: Stack, api: str) -> None:
    pad = image_pad_id(vision.tok)
    results = run(vision.server, SEEDS, GuiConfig(api=api, keep_frames=True))  # type: ignore[arg-type]
    for result in results:
        assert_solved(result)
        assert result.screenshots == result.turns == len(result.frames)  # one screen before each turn
        assert result.frames == replayed_frames(result.seed, result.events)
        (sample,) = result.samples
        tokens, mask = sample.tokens.tolist(), sample.loss_mask
        runs = pad_runs(tokens, pad)
        assert [n for _, n in runs] == [PADS_PER_SCREENSHOT] * result.screenshots
        for start, n in runs:
            assert int(mask[start:start + n].sum()) == 0  # the model saw the image, it did not sample it
            assert tokens[start - 1] == pad - 3 and tokens[start + n] == pad - 2  # <|vision_start|> .. <|vision_end|>
        # The sample's own records: each image's span, its content hash (the PNG the agent sent) and its grid; the
        # pixels a trainer's vision tower takes, one row per patch of each grid.
        records = sample.metadata["images"]
        assert [r["span"] for r in records] == [[start, start + n] for start, n in runs]
        assert [r["digest"] for r in records] == ["sha256:" + hashlib.sha256(png).hexdigest() for png in result.frames]
        assert all(r["image_grid_thw"] == list(GRID) for r in records)
        assert sample.image_grid_thw is not None and sample.pixel_values is not None
        assert sample.image_grid_thw.tolist() == [list(GRID)] * result.screenshots
        assert sample.pixel_values.shape == (result.screenshots * GRID[1] * GRID[2], 3 * 2 * 16 * 16)


@needs_vision
def test_the_same_seed_gives_the_same_tokens_again(vision: Stack) -> None:
    chat = run(vision.server, [5, 5], GuiConfig(api="chat"))
    for result in chat:
        assert_solved(result)
    tokens = [r.samples[0].tokens.tolist() for r in chat]
    assert tokens[0] == tokens[1]  # the screens, the prompt and the scripted replies are all functions of the seed


@needs_vision
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_forced_calls_without_thinking_reach_the_engine_as_a_grammar(vision: Stack, api: str) -> None:
    """`--tool-choice required --no-thinking`, the options for real models, in each API's own spelling: every reply is
    a call held to the tools' strict schemas (the sim writes a schema instance under a forced grammar, not the
    scripted arguments), so the episode acts on every turn, on the screen, up to the turn limit."""
    config = GuiConfig(api=api, tool_choice="required", thinking=False, max_turns=6)  # type: ignore[arg-type]
    (result,) = run(vision.server, [0], config)
    assert result.ok, result.error
    assert result.stop_reason == "turn_limit" and result.turns == 6 and result.final_answer is None
    assert result.actions >= 6 and len(result.samples) == 1
    assert not [e for e in result.events if e.startswith("error") or "outside" in e], result.events


def test_text_observations_drive_a_text_only_model(stack_factory: StackFactory) -> None:
    with stack_factory(family=TEXT) as stack:
        results = [*run(stack.server, [0], GuiConfig(api="chat", observation="text")),
                   *run(stack.server, [1], GuiConfig(api="responses", observation="text")),
                   *run(stack.server, [2], GuiConfig(api="messages", observation="text"))]
    for result in results:
        assert_solved(result)
        assert result.screenshots == 0 and result.events[-1].startswith("Clicked Save: saved note1.txt")


@needs_vision
def test_make_demo_gui_runs_its_episodes_and_prints_the_spans(tokenizer_dirs: dict[str, Path],
                                                              tmp_path: Path) -> None:
    out = tmp_path / "gui"
    cmd = [sys.executable, "-m", "examples.gui_agent", "--tokenizers", str(tokenizer_dirs[TEXT].parent),
           "--episodes", "3", "--concurrency", "3", "--out", str(out)]  # as `make demo-gui` runs it
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == summary["reward 1.0"] == summary["samples"] == 3 and summary["errors"] == 0
    assert summary["image placeholder tokens"] == PADS_PER_SCREENSHOT * summary["screenshots"]
    assert summary["images in samples"] == summary["screenshots"] and summary["spans off the pad runs"] == 0
    assert done.stdout.count(" 1x16x20") == summary["screenshots"]  # each image's span, hash and grid printed
    assert "MISMATCH" not in done.stdout
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [e["api"] for e in episodes] == ["chat", "responses", "messages"]
    assert len(list((out / "frames").glob("*.png"))) == episodes[0]["turns"]
    assert "stopped on SIGTERM: session-server (exit code 0)" in done.stdout
