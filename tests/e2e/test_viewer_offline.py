"""`python -m rollout.view`: the offline page of a samples file, in a real browser, with and without the trainer check.

The samples come from a live server over loopback (the emulated engine); the CLI runs as a process, as a user runs it.
For the check overlay the policy is a tiny random Qwen3 written to disk with transformers: the sample's rollout
logprobs are set to that policy's own (so the check passes everywhere) and then three tokens are moved by known
amounts, so the page must outline exactly those three, list them worst first and link each to its place. The images
of a vision sample are rebuilt from its pixel values and shown at their pad runs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from support.browser import headless_chromium, screenshot, wait_ready
from support.image_episodes import screenshot as desktop
from support.images import data_url
from support.server import new_session
from support.stack import Stack, launch_stack
from trajectory import samples_from_json, samples_to_json

ROOT = Path(__file__).resolve().parents[2]
SHIFTS = {0: 0.25, 1: 0.04, 2: 0.005}  # sampled token (by rank among the compared ones) -> logprob moved by
WITHIN = 3  # one more moved by 4e-4: within the 1e-3 bar, not outlined


@pytest.fixture(scope="module")
def stack(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack({"qwen3-vl": tokenizer_dirs["qwen3"]}, tmp_path_factory.mktemp("stack"),
                      family="qwen3-vl") as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as b:
        yield b


def chat(server: str, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    resp = httpx.post(f"{server}/sessions/{sid}/v1/chat/completions", timeout=60,
                      json={"model": "m", "messages": messages, "max_tokens": 24})
    assert resp.status_code == 200, resp.text
    message: dict[str, Any] = resp.json()["choices"][0]["message"]
    return message


def episode(server: str, image: bool) -> str:
    sid = new_session(server)
    first: Any = "What is the capital of France? [[sim: think]] [[sim: reply Paris.]]"
    if image:
        first = [{"type": "text", "text": first}, {"type": "image_url", "image_url": {"url": data_url(desktop(3))}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    messages.append(chat(server, sid, messages))
    messages.append({"role": "user", "content": "And of Italy? [[sim: tokens 12]]"})
    chat(server, sid, messages)
    return sid


def run_view(*args: str | Path) -> None:
    done = subprocess.run([sys.executable, "-m", "rollout.view", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def policy_dir(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 on Qwen3's vocabulary, with its tokenizer, as a checkpoint directory."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dirs["qwen3"])
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("policy")
    Qwen3ForCausalLM(config).float().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_the_check_overlay_outlines_and_lists_the_tokens_the_trainer_disagrees_on(
        stack: Stack, browser: Any, policy_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.logprob_check import check_logprobs

    sid = episode(stack.server, image=False)
    sample = samples_from_json(httpx.post(f"{stack.server}/sessions/{sid}/samples", timeout=60).json())[0]
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    own = check_logprobs([sample], model).per_sample[0].trainer_log_probs
    compared = [int(p) for p in np.flatnonzero(sample.loss_mask) if p > 0]
    moved = {compared[3 * k + 2]: shift for k, shift in SHIFTS.items()}
    within = compared[3 * WITHIN + 2]
    logprobs = own.copy()
    for position, shift in {**moved, within: 4e-4}.items():
        logprobs[position] -= shift
    sample = dataclasses.replace(sample, rollout_log_probs=logprobs)
    samples_file = tmp_path / "samples.json"
    samples_file.write_text(json.dumps(samples_to_json([sample])))
    page = tmp_path / "checked.html"
    run_view(samples_file, "-o", page, "--checkpoint", policy_dir, "--worst", "5", "--title", "a checked sample")

    browser.get(page.as_uri())
    wait_ready(browser)
    bad = browser.find_elements("css selector", "#seg0 .flow .t.bad")
    assert sorted(int(b.get_attribute("data-i")) for b in bad) == sorted(moved)  # drawn blocks hold them all
    links = browser.find_elements("css selector", "#worst0 a.worst")
    assert [int(a.get_attribute("href").rsplit("t", 1)[1]) for a in links[:4]] == [*moved, within]
    links[1].click()
    position = next(iter(list(moved)[1:]))
    rows = {r.get_attribute("data-k"): r.find_element("css selector", "td").text
            for r in browser.find_elements("css selector", "#panel tr[data-k]")}
    assert rows["position"] == str(position)
    assert float(rows["trainer_logprob"]) == pytest.approx(float(own[position]), abs=2e-6)
    assert rows["abs_diff"].endswith("beyond 0.001")
    assert float(rows["abs_diff"].split()[0]) == pytest.approx(SHIFTS[1], rel=1e-3)
    assert "sel" in browser.find_element("css selector", f'#seg0 .flow [data-i="{position}"]').get_attribute("class")
    browser.execute_script("window.scrollTo(0, 0)")
    header = browser.find_element("id", "header").text
    assert "max |diff| 0.25 (beyond 0.001)" in header
    browser.set_window_size(1440, 1100)
    screenshot(browser, "offline-check.png")
    browser.set_window_size(1440, 1000)


def test_a_vision_sample_shows_its_images_rebuilt_from_pixel_values(
        stack: Stack, browser: Any, tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    sid = episode(stack.server, image=True)
    resp = httpx.post(f"{stack.server}/sessions/{sid}/samples", timeout=60,
                      headers={"Accept": "application/octet-stream"})
    samples_file = tmp_path / "samples.safetensors"
    samples_file.write_bytes(resp.content)
    page = tmp_path / "vision.html"
    run_view(samples_file, "-o", page, "--tokenizer", tokenizer_dirs["qwen3"])
    browser.get(page.as_uri())
    wait_ready(browser)
    holder = browser.find_element("css selector", '#seg0 .flow [data-img="0"]')
    start = json.loads(browser.execute_script("return JSON.stringify(trajectoryView.document().segments[0].images)"))
    assert holder.get_attribute("data-i") == str(start[0]["span"][0])
    size = browser.execute_script("var i = arguments[0].querySelector('img'); return [i.naturalWidth, "
                                  "i.naturalHeight]", holder)
    assert size == [320, 256]  # the processor's resize of the 320x240 screenshot (grid 1x16x20)
