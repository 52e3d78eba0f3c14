"""The trajectory viewer in a real browser (headless chromium, selenium) against a live server over loopback.

An image episode with a tool call runs through Chat Completions on the emulated engine; then the list page at /view/
and the session's page are opened: clicking a token shows its id, piece, mask, logprob and weight version as the
session's samples have them; sampled and prompt tokens are styled apart; the screenshot sits at its pad run; the tool
call is shown with its arguments. The pages are read-only (the session's samples are unchanged by looking) and
behind --admin-token when one is set. Screenshots go to out/viewer/ (docs/viewer.md shows them).
"""

from __future__ import annotations

import json
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
from trajectory import Sample, samples_from_json
from trajectory.view import SegmentExtras, build_document, offline_page, segment_of_sample

TOKEN = "view-s3cret"
TOOLS = [{"type": "function", "function": {
    "name": "click", "description": "Click at a point of the screen",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                   "required": ["x", "y"]}}}]


@pytest.fixture(scope="module")
def stack(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A vision family on the sim, one server open and one behind an admin token."""
    with launch_stack({"qwen3-vl": tokenizer_dirs["qwen3"]}, tmp_path_factory.mktemp("stack"), family="qwen3-vl",
                      servers={"server": (), "guarded": ("--admin-token", TOKEN)}) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as b:
        yield b


def chat(server: str, sid: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    resp = httpx.post(f"{server}/sessions/{sid}/v1/chat/completions", timeout=60,
                      json={"model": "m", "messages": messages, "max_tokens": 48, **extra})
    assert resp.status_code == 200, resp.text
    message: dict[str, Any] = resp.json()["choices"][0]["message"]
    return message


def gui_episode(server: str) -> str:
    """Look at a screenshot, click (a tool call), read the tool's result and a second screenshot, answer."""
    sid = new_session(server, {"task": "open the settings window"})
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You operate a desktop. Use the click tool."},
        {"role": "user", "content": [
            {"type": "text", "text": "Open the settings window. [[sim: think]] "
                                     '[[sim: tool_call name=click args={"x": 52, "y": 160}]]'},
            {"type": "image_url", "image_url": {"url": data_url(desktop(1))}}]},
    ]
    reply = chat(server, sid, messages, tools=TOOLS)
    assert reply["tool_calls"][0]["function"]["name"] == "click"
    messages.append(reply)
    messages.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": [
        {"type": "text", "text": "clicked; the screen is now: [[sim: reply The settings window is open.]]"},
        {"type": "image_url", "image_url": {"url": data_url(desktop(2))}}]})
    reply = chat(server, sid, messages, tools=TOOLS)
    assert reply["content"] == "The settings window is open."
    return sid


def samples_of(server: str, sid: str) -> list[Sample]:
    resp = httpx.post(f"{server}/sessions/{sid}/samples", timeout=60)
    assert resp.status_code == 200, resp.text
    return samples_from_json(resp.json())


@pytest.fixture(scope="module")
def episode(stack: Stack) -> str:
    return gui_episode(stack.server)


def details(browser: Any) -> dict[str, str]:
    rows = browser.find_elements("css selector", "#panel tr[data-k]")
    return {row.get_attribute("data-k"): row.find_element("css selector", "td").text for row in rows}


def click_token(browser: Any, position: int) -> dict[str, str]:
    span = browser.find_element("css selector", f'#seg0 .flow [data-i="{position}"]')
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", span)
    span.click()
    return details(browser)


def test_list_page_links_each_live_session(stack: Stack, browser: Any, episode: str) -> None:
    browser.get(f"{stack.server}/view/")
    wait_ready(browser)
    row = browser.find_element("css selector", f'#sessions tr[data-session="{episode}"]')
    cells = [td.text for td in row.find_elements("css selector", "td")]
    assert cells[1:6] == ["idle", "1", "2", str(len(samples_of(stack.server, episode)[0].tokens)), "–"]
    assert cells[8] == "default"  # the sim's weight version
    assert json.loads(cells[9]) == {"task": "open the settings window"}
    screenshot(browser, "list.png")
    row.find_element("css selector", "a").click()
    wait_ready(browser)
    assert browser.current_url == f"{stack.server}/view/sessions/{episode}"


def test_clicking_a_token_shows_what_the_sample_holds(stack: Stack, browser: Any, episode: str) -> None:
    sample = samples_of(stack.server, episode)[0]
    browser.get(f"{stack.server}/view/sessions/{episode}")
    wait_ready(browser)
    sampled = int(np.flatnonzero(sample.loss_mask)[-3])  # a sampled token of the last reply
    shown = click_token(browser, sampled)
    assert shown["position"] == str(sampled)
    assert shown["token_id"] == str(sample.tokens[sampled])
    assert shown["loss_mask"].startswith("1")
    assert float(shown["logprob"]) == pytest.approx(float(sample.rollout_log_probs[sampled]), abs=1e-5)
    assert shown["weight_version"] == "default"
    assert shown["turn"] == "1 (completion)"
    assert json.loads(shown["piece"]) != ""
    shown = click_token(browser, 3)  # inside the system prompt
    assert shown["loss_mask"].startswith("0") and shown["logprob"] == "–" and shown["turn"] == "0 (prompt)"
    selected = browser.find_elements("css selector", ".t.sel")
    assert [s.get_attribute("data-i") for s in selected] == ["3"]


def test_sampled_and_prompt_tokens_look_different(stack: Stack, browser: Any, episode: str) -> None:
    browser.get(f"{stack.server}/view/sessions/{episode}")
    wait_ready(browser)

    def style(selector: str) -> tuple[str, str]:
        span = browser.find_element("css selector", f"#seg0 .flow {selector}")
        return (span.value_of_css_property("color"), span.value_of_css_property("background-color"))

    sampled, prompt = style(".t.s:not(.sp)"), style(".t.p:not(.sp)")
    assert sampled != prompt
    assert sampled[1] != "rgba(0, 0, 0, 0)" and prompt[1] == "rgba(0, 0, 0, 0)"  # sampled tokens are highlighted


def test_images_appear_at_their_pad_runs_and_the_tool_call_is_shown(stack: Stack, browser: Any,
                                                                     episode: str) -> None:
    sample = samples_of(stack.server, episode)[0]
    spans = [image["span"] for image in sample.metadata["images"]]
    assert len(spans) == 2
    browser.get(f"{stack.server}/view/sessions/{episode}")
    wait_ready(browser)
    for k, (start, end) in enumerate(spans):
        holder = browser.find_element("css selector", f'#seg0 .flow [data-img="{k}"]')
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", holder)
        assert holder.get_attribute("data-i") == str(start)
        assert f"{end - start} pads" in holder.text
        img = holder.find_element("css selector", "img")
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 320
    shown = click_token(browser, spans[1][0])
    assert shown["image"].startswith(f"1 · span [{spans[1][0]}, {spans[1][1]})")
    call = browser.find_element("css selector", "#seg0 .toolcall").text
    assert "click" in call and '"x": 52' in call
    banner = browser.find_elements("css selector", "#seg0 .turn")[1].text
    assert "tool result" in banner
    # The picture for docs/viewer.md: from the first screenshot to the tool call, a sampled token selected.
    click_token(browser, int(np.flatnonzero(sample.loss_mask)[5]))
    browser.set_window_size(1440, 1500)
    first = browser.find_element("css selector", '#seg0 .flow [data-img="0"]')
    browser.execute_script("window.scrollTo(0, arguments[0].getBoundingClientRect().top + window.scrollY - 140)",
                           first)
    path = screenshot(browser, "session.png")
    browser.set_window_size(1440, 1000)
    assert path.stat().st_size > 10_000


def test_looking_changes_nothing(stack: Stack, episode: str) -> None:
    before = httpx.get(f"{stack.server}/admin/sessions").json()["sessions"]
    for _ in range(3):
        assert httpx.get(f"{stack.server}/view/api/sessions/{episode}").status_code == 200
    after = httpx.get(f"{stack.server}/admin/sessions").json()["sessions"]
    idle = {s["id"]: s["idle_s"] for s in after}
    assert idle[episode] >= next(s["idle_s"] for s in before if s["id"] == episode)  # not marked active
    doc = httpx.get(f"{stack.server}/view/api/sessions/{episode}").json()
    sample = samples_of(stack.server, episode)[0]
    assert doc["segments"][0]["tokens"] == sample.tokens.tolist()
    assert doc["segments"][0]["mask"] == "".join(map(str, sample.loss_mask.tolist()))
    assert httpx.get(f"{stack.server}/view/sessions/unknown").status_code == 404


def test_admin_token_guards_the_pages(stack: Stack, browser: Any) -> None:
    guarded = stack.servers["guarded"]
    sid = new_session(guarded)
    for path in ("/view/", "/view/api/sessions", f"/view/sessions/{sid}", f"/view/api/sessions/{sid}"):
        assert httpx.get(guarded + path).status_code == 401
        assert httpx.get(guarded + path, params={"token": "wrong"}).status_code == 401
        assert httpx.get(guarded + path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    browser.get(f"{guarded}/view/?token={TOKEN}")
    wait_ready(browser)  # the page's own fetch carried the token as a header
    link = browser.find_element("css selector", f'#sessions tr[data-session="{sid}"] a')
    link.click()
    wait_ready(browser)
    assert browser.find_element("id", "header").text.count(sid) == 1


def test_a_64k_token_segment_stays_responsive(browser: Any, tmp_path: Path) -> None:
    """A synthetic 64k-token sample as one offline page: drawn lazily, so it opens at once; the time is logged (a
    timing is never a verdict here), and a jump to its last token draws that token."""
    n, rng = 65_536, np.random.default_rng(0)
    tokens = rng.integers(0, 5000, n).astype(np.int32)
    mask = (np.arange(n) % 1000 >= 400).astype(np.uint8)
    logprobs = np.where(mask == 1, -rng.random(n), 0.0).astype(np.float32)
    turns = [[k * 1000 + 400, 600] for k in range(n // 1000)]
    sample = Sample(tokens=tokens, loss_mask=mask, rollout_log_probs=logprobs, response_length=n - 400,
                    status="completed", metadata={"turns": turns, "weight_version_spans": [["v1", 400, n]]})
    doc = build_document("samples", "64k tokens", {"tokens": n}, [segment_of_sample(sample, SegmentExtras("sample 0"))],
                   {str(i): f"w{i} " for i in range(5000)})
    page = tmp_path / "big.html"
    page.write_text(offline_page(doc))
    browser.get(page.as_uri())
    wait_ready(browser)
    drawn, blocks = browser.execute_script("return [document.querySelectorAll('.block[data-drawn]').length, "
                                           "document.querySelectorAll('.block').length]")
    elapsed = browser.execute_script("return window.__viewRenderedMs")
    print(f"64k-token segment: first tokens drawn {elapsed:.0f} ms after the script started; {drawn} of {blocks} "
          "blocks drawn")
    assert 0 < drawn < blocks
    browser.execute_script(f"trajectoryView.select(0, {n - 1}, true)")
    assert details(browser)["token_id"] == str(tokens[-1])
