"""Images through the session server against the emulated engine: every API, plain and streamed, token-exact.

A multi-turn episode with a new screenshot per turn goes through Chat Completions (`image_url` data URLs), Responses
(`input_image`, later turns by `previous_response_id`, so earlier images come from the session's store) and Anthropic
Messages (base64 `image` blocks). `check_exact` (tests/support/image_episodes.py) holds each turn to what the engine
got: the stored prompt with every run collapsed to one pad, `image_data` with every image so far in order, and the
engine's own expansion of that input equal to the stored prompt. A bad image is a 400 in each API's own error shape
naming its field; a history with another picture rolls back, and the mismatch report still sees only assistant
differences.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest

from rollout import SessionClient
from support.image_episodes import APIS, check_exact, data_url, digest, episode, screenshot
from support.server import RecordingProxy, new_session
from support.stack import Stack, launch_stack
from trajectory import samples_from_json, samples_from_safetensors
from trajectory.image_pixels import image_files

VISION = "qwen3-vl"


@pytest.fixture(scope="module")
def stack(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The sim and a server on the Qwen3 vocabulary as the qwen3-vl family (its tokenizer carries the vision
    markers; no preprocessor_config.json: the published Qwen3-VL image settings)."""
    servers = {"server": ("--max-images", "4", "--max-image-pixels", str(1024 * 1024)),
               "sessions": ("--engine-sessions",)}
    with launch_stack({VISION: tokenizer_dirs["qwen3"]}, tmp_path_factory.mktemp("stack"), family=VISION,
                      sim_args=["--token-latency-ms", "1"], servers=servers, proxied={"server"}) as s:
        yield s


def base(stack: Stack, sid: str) -> str:
    return f"{stack.server}/sessions/{sid}/v1"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_an_image_episode_is_token_exact(stack: Stack, proxy: RecordingProxy, api: str, stream: bool) -> None:
    sid = new_session(stack.server)
    images = [screenshot(i) for i in range(3)]
    replies = asyncio.run(episode(api, base(stack, sid), images, stream))
    assert replies == [f"seen {i}" for i in range(3)]
    calls = [c for c in proxy.settled() if c["path"] == "/generate" and c["routing_key"] == sid]
    assert all(c["request"]["stream"] is stream for c in calls)
    report = check_exact(stack.server, stack.engine, calls, sid, images)
    assert [i["span"][1] - i["span"][0] for i in report["images"]] == [80, 80, 80]
    assert report["pixel_values"] == [3 * 320, 1536]


@pytest.mark.parametrize("format", ["safetensors", "json"])
def test_image_bytes_give_the_servers_pixel_values_on_the_trainers_side(stack: Stack, format: str) -> None:
    """`rollout` collects the images as the agent's files (its default) and computes the pixel values itself: equal,
    bit for bit, to the ones the server computes when asked for pixels, in a payload a small fraction of the size."""
    images = [screenshot(i) for i in range(3)]

    async def run() -> tuple[Any, Any]:
        async with SessionClient(stack.server) as client:
            sid = await client.create()
            await episode("chat", client.base_url(sid), images, stream=False)
            return await client.collect(sid, format=format), await client.collect(sid, format=format,
                                                                                  images="pixels")

    (local,), (served,) = asyncio.run(run())
    assert served.image_bytes is None and served.pixel_values is not None and served.image_grid_thw is not None
    assert local.pixel_values is not None and local.image_grid_thw is not None
    assert local.pixel_values.shape == served.pixel_values.shape == (3 * 320, 1536)
    assert np.array_equal(local.pixel_values, served.pixel_values)
    assert np.array_equal(local.image_grid_thw, served.image_grid_thw)
    assert image_files(local) == images  # the files exactly as the agent sent them, in the metadata's order
    assert [i["digest"] for i in local.metadata["images"]] == [digest(d) for d in images]
    assert local.metadata["image_processor"]["patch_size"] == 16
    assert np.array_equal(local.tokens, served.tokens)


def test_the_samples_image_form_is_checked_and_sized(stack: Stack) -> None:
    """Without `rollout`, `{"images": "bytes"}` is the small payload (no pixel values), the default the large one; any
    other form is a 400."""
    sid = new_session(stack.server)
    images = [screenshot(i) for i in range(3)]
    asyncio.run(episode("chat", base(stack, sid), images, stream=False))
    url, octets = f"{stack.server}/sessions/{sid}/samples", {"accept": "application/octet-stream"}
    by_form = {form: httpx.post(url, json=body, headers=octets, timeout=120).content
               for form, body in (("pixels", {}), ("bytes", {"images": "bytes"}))}
    (pixels,), (files,) = (samples_from_safetensors(by_form[f]) for f in ("pixels", "bytes"))
    assert files.pixel_values is None and files.image_grid_thw is None and image_files(files) == images
    assert pixels.image_bytes is None and pixels.pixel_values is not None
    assert len(by_form["bytes"]) < sum(map(len, images)) + 20_000 < 5_000_000 < len(by_form["pixels"])
    (from_json,) = samples_from_json(httpx.post(url, json={"images": "bytes"}, timeout=120).json())
    assert image_files(from_json) == images
    cut = samples_from_safetensors(httpx.post(url, json={"images": "bytes", "max_seq_len": 100}, headers=octets,
                                              timeout=120).content)[0]
    assert image_files(cut) == images[:len(cut.metadata["images"])] and len(cut.metadata["images"]) < 3
    refused = httpx.post(url, json={"images": "png"}, timeout=60)
    assert refused.status_code == 400 and "'images' must be one of ['pixels', 'bytes']" in refused.text


def _bad(api: str, url: str, count: int = 1) -> dict[str, Any]:
    """A request body of `api` whose user message carries `count` copies of the image at `url`."""
    if api == "chat":
        return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, *[{"type": "image_url", "image_url": {"url": url}}] * count]}]}
    if api == "responses":
        return {"model": "m", "max_output_tokens": 4, "input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "x"}, *[{"type": "input_image", "image_url": url}] * count]}]}
    if url.startswith("data:"):
        source = {"type": "base64", "media_type": url[5:url.index(";")], "data": url.split(",", 1)[1]}
    else:
        source = {"type": "url", "url": url}
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, *[{"type": "image", "source": source}] * count]}]}


def _png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (5, 5, 5)).save(out, "PNG")
    return out.getvalue()


_ROUTE = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}
_BAD = [
    ("not an image", data_url(b"plain text, no picture"), 1, "is not an image"),
    ("too many pixels", data_url(_png(1100, 1000)), 1, "1100x1000 pixels, more than the 1048576 allowed"),
    ("too many images", data_url(_png(64, 64)), 5, "a request may carry at most 4 images"),
    ("remote", "http://127.0.0.1:9/a.png", 1, "remote URL"),
]


@pytest.mark.parametrize(("what", "url", "count", "why"), _BAD, ids=[b[0] for b in _BAD])
@pytest.mark.parametrize("api", APIS)
def test_a_bad_image_is_a_400_in_the_apis_shape(stack: Stack, proxy: RecordingProxy, api: str, what: str,
                                                 url: str, count: int, why: str) -> None:
    sid = new_session(stack.server)
    answer = httpx.post(f"{base(stack, sid)}/{_ROUTE[api]}", json=_bad(api, url, count), timeout=60)
    assert answer.status_code == 400, answer.text
    body = answer.json()
    field = {"chat": "messages[0].content[", "responses": "input[0].content[", "messages": "messages[0].content["}
    if api == "messages":  # Anthropic's shape
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:  # OpenAI's, as Chat Completions and the Responses API write it
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_request"
    message = body["error"]["message"]
    assert why in message and field[api] in message, message
    assert not [c for c in proxy.calls if c["path"] == "/generate" and c["routing_key"] == sid]


def test_sdk_errors_are_the_apis_own(stack: Stack) -> None:
    """What an agent's SDK raises for a bad image: openai.BadRequestError, anthropic.BadRequestError."""
    sid = new_session(stack.server)

    async def run() -> None:
        chat = openai.AsyncOpenAI(base_url=base(stack, sid), api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="is not an image"):
            await chat.chat.completions.create(**_bad("chat", data_url(b"nope")))
        claude = anthropic.AsyncAnthropic(base_url=f"{stack.server}/sessions/{sid}", api_key="unused", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="is not an image"):
            await claude.messages.create(**_bad("messages", data_url(b"nope")))

    asyncio.run(run())


def test_another_picture_in_the_history_rolls_back(stack: Stack, proxy: RecordingProxy) -> None:
    """The agent resends turn 2 with a different screenshot: turn 2 is rolled back, the new prompt is turn 1's stored
    tokens plus the new messages, and image_data has the first picture and the new one."""
    sid = new_session(stack.server)
    first, second, other = screenshot(0), screenshot(1), screenshot(7)
    asyncio.run(episode("chat", base(stack, sid), [first, second], stream=False))
    before = httpx.get(f"{stack.server}/sessions/{sid}", timeout=60).json()
    client = openai.OpenAI(base_url=base(stack, sid), api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Screen 0: what do you see? [[sim: reply seen 0]]"},
                                     {"type": "image_url", "image_url": {"url": data_url(first)}}]},
        {"role": "assistant", "content": "seen 0"},
        {"role": "user", "content": [{"type": "text", "text": "Screen 1: what do you see? [[sim: reply again]]"},
                                     {"type": "image_url", "image_url": {"url": data_url(other)}}]}]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=4)
    assert raw.parse().choices[0].message.content == "again"
    assert raw.headers["x-session-rollback"] == "1; reason=content"
    after = httpx.get(f"{stack.server}/sessions/{sid}", timeout=60).json()
    assert after["rollbacks"] == 1 and len(after["records"]) == 2
    turn_one = before["records"][0]["prompt_len"] + before["records"][0]["completion_len"]
    assert after["token_ids"][:turn_one] == before["token_ids"][:turn_one]
    last = [c for c in proxy.settled() if c["path"] == "/generate" and c["routing_key"] == sid][-1]
    assert [base64.b64decode(u.split(",", 1)[1]) for u in last["request"]["image_data"]] == [first, other]
    report = after["mismatch_report"]
    assert "error" not in report and report["assistant_only"], report


def test_count_tokens_counts_each_image_as_its_run(stack: Stack) -> None:
    """Anthropic's count_tokens with an image: the prompt as the engine will expand it (80 pads for 320x240)."""
    sid = new_session(stack.server)
    with_image = _bad("messages", data_url(screenshot(0)))
    without = {**with_image, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    url = f"{stack.server}/sessions/{sid}/v1/messages/count_tokens"
    counted = [httpx.post(url, json=body, timeout=60).json()["input_tokens"] for body in (with_image, without)]
    assert counted[0] - counted[1] == 80 + 2  # the run and its two markers


def test_engine_sessions_refuse_images_and_leave_the_session_usable(stack: Stack) -> None:
    """Under --engine-sessions (only new tokens are sent) an image turn is a 400, and it holds nothing: the same
    session answers a text turn at once (no 409 from a slot left behind)."""
    server = stack.servers["sessions"]
    sid = new_session(server)
    url = f"{server}/sessions/{sid}/v1/chat/completions"
    refused = httpx.post(url, json=_bad("chat", data_url(screenshot(0))), timeout=60)
    assert refused.status_code == 400 and "--engine-sessions" in refused.json()["error"]["message"]
    text = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi [[sim: reply ok]]"}]}
    answer = httpx.post(url, json=text, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ok"
