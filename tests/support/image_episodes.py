"""Image episodes through each API of the session server and the checks that they ran token-exact: shared by the
emulated-engine tier (tests/e2e/test_server_images.py) and the real-engine tier (tests/sglang/test_real_images.py).

An episode sends one new screenshot per turn through the official SDK of its API (openai for Chat Completions and
Responses, anthropic for Messages), plain or streamed. `check_exact` then holds the session to what the engine
received, call by call: its `input_ids` are the stored prompt with each image's run collapsed to one pad, its
`image_data` every image so far in order, and the engine's own expansion of that input (asked again with
`return_prompt_token_ids`) is exactly the stored prompt; the sample names every image's span, hash and grid and
carries its pixel values.
"""

from __future__ import annotations

import base64
import hashlib
import io
import uuid
from typing import Any

import anthropic
import httpx
import numpy as np
import openai

from support.images import collapse_pads, data_url, pad_runs
from trajectory import samples_from_safetensors
from trajectory.image_grid import IMAGE_PAD_ID

APIS = ("chat", "responses", "messages")


def screenshot(i: int, width: int = 320, height: int = 240) -> bytes:
    """A distinct little 'desktop' per `i`: a title bar, a window and a button at places that depend on `i`."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (30 + 20 * i % 200, 60, 90))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 16), fill=(220, 220, 220))
    draw.rectangle((20 + 10 * i, 30, 200 + 10 * i, 180), fill=(250, 250, 250), outline=(0, 0, 0))
    draw.rectangle((40 + 7 * i, 150, 100 + 7 * i, 170), fill=(0, 120, 215))
    draw.text((30 + 10 * i, 40), f"window {i}", fill=(0, 0, 0))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _text(i: int, directive: bool) -> str:
    return f"Screen {i}: what do you see?" + (f" [[sim: reply seen {i}]]" if directive else "")


async def episode(api: str, base: str, images: list[bytes], stream: bool, *, directive: bool = True,
                  max_tokens: int = 8) -> list[str]:
    """One turn per image through `api` at `base` (a session's /v1 URL); returns the replies' texts."""
    if api == "chat":
        return await _chat(base, images, stream, directive, max_tokens)
    if api == "responses":
        return await _responses(base, images, stream, directive, max_tokens)
    return await _messages(base, images, stream, directive, max_tokens)


async def _chat(base: str, images: list[bytes], stream: bool, directive: bool, max_tokens: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = []
    replies = []
    for i, image in enumerate(images):
        messages.append({"role": "user", "content": [{"type": "text", "text": _text(i, directive)},
                                                     {"type": "image_url", "image_url": {"url": data_url(image)}}]})
        if stream:
            chunks = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                          stream=True)
            content, reasoning = "", ""
            async for chunk in chunks:
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    content += delta.content or ""
                    reasoning += getattr(delta, "reasoning_content", None) or ""
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
        else:
            reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        replies.append(message.get("content") or "")
    await client.close()
    return replies


async def _responses(base: str, images: list[bytes], stream: bool, directive: bool, max_tokens: int) -> list[str]:
    """Turns after the first name the previous response instead of resending it: its images come from the session."""
    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
    previous: str | None = None
    replies = []
    for i, image in enumerate(images):
        item = {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": _text(i, directive)},
            {"type": "input_image", "image_url": data_url(image), "detail": "auto"}]}
        kwargs: dict[str, Any] = {"model": "m", "input": [item], "max_output_tokens": max_tokens}
        if previous is not None:
            kwargs["previous_response_id"] = previous
        if stream:
            events = await client.responses.create(**kwargs, stream=True)
            response = None
            async for event in events:
                if event.type == "response.completed":
                    response = event.response
            assert response is not None
        else:
            response = await client.responses.create(**kwargs)
        previous = response.id
        replies.append(response.output_text)
    await client.close()
    return replies


async def _messages(base: str, images: list[bytes], stream: bool, directive: bool, max_tokens: int) -> list[str]:
    client = anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = []
    replies = []
    for i, image in enumerate(images):
        messages.append({"role": "user", "content": [
            {"type": "text", "text": _text(i, directive)},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}]})
        if stream:
            async with client.messages.stream(model="m", max_tokens=max_tokens, messages=messages) as events:
                reply = await events.get_final_message()
        else:
            reply = await client.messages.create(model="m", max_tokens=max_tokens, messages=messages)
        blocks = [block.model_dump(exclude_none=True) for block in reply.content]
        messages.append({"role": "assistant", "content": blocks or ""})
        replies.append("".join(b.get("text", "") for b in blocks))
    await client.close()
    return replies


def check_exact(server: str, engine: str, calls: list[dict[str, Any]], sid: str, images: list[bytes],
                pad: int = IMAGE_PAD_ID) -> dict[str, Any]:
    """The session against the engine calls it made (the recording proxy's, in order), one call per image; returns
    the sample's image metadata and payload size for the caller's report."""
    info = httpx.get(f"{server}/sessions/{sid}", timeout=60).json()
    stored = list(info["token_ids"])
    records = info["records"]
    assert len(calls) == len(records) == len(images), (len(calls), len(records))
    assert info["rollbacks"] == 0
    previous_end = 0
    with httpx.Client(base_url=engine, timeout=300) as client:
        for k, (call, record) in enumerate(zip(calls, records, strict=True)):
            request, response = call["request"], call["response"]
            prompt_len = record["prompt_len"]
            assert prompt_len >= previous_end  # the earlier turns' tokens are this prompt's head (TITO)
            previous_end = prompt_len + record["completion_len"]
            assert request["input_ids"] == collapse_pads(stored[:prompt_len]), f"turn {k}: input is not collapsed"
            sent = [base64.b64decode(url.split(",", 1)[1]) for url in request["image_data"]]
            assert [digest(d) for d in sent] == [digest(d) for d in images[: k + 1]], f"turn {k}: image_data"
            assert response["meta_info"]["prompt_tokens"] == prompt_len
            assert response["meta_info"].get("image_tokens") == sum(n for _, n in pad_runs(stored[:prompt_len], pad))
            # the engine's own expansion of exactly this input is the stored prompt
            again = {key: value for key, value in request.items() if key not in ("session_params", "stream")}
            again.update(rid=uuid.uuid4().hex, stream=False, return_prompt_token_ids=True,
                         sampling_params={**request["sampling_params"], "max_new_tokens": 1})
            answer = client.post("/generate", json=again)
            assert answer.status_code == 200, answer.text
            assert answer.json()["prompt_token_ids"] == stored[:prompt_len], f"turn {k}: engine expansion differs"
    payload = httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=120,
                         headers={"accept": "application/octet-stream"}).content
    (sample,) = samples_from_safetensors(payload)
    assert sample.tokens.tolist() == stored
    described = sample.metadata["images"]
    runs = pad_runs(stored, pad)
    assert [tuple(i["span"]) for i in described] == [(s, s + n) for s, n in runs]
    assert [i["digest"] for i in described] == [digest(d) for d in images]
    assert sample.image_grid_thw is not None and sample.pixel_values is not None
    assert sample.image_grid_thw.tolist() == [i["image_grid_thw"] for i in described]
    assert len(sample.pixel_values) == int(sample.image_grid_thw.prod(axis=1).sum())
    assert all(n == int(np.prod(g)) // 4 for (_, n), g in zip(runs, sample.image_grid_thw, strict=True))
    pads = sample.tokens == pad
    assert (sample.loss_mask[pads] == 0).all() and (sample.rollout_log_probs[pads] == 0).all()
    return {"images": described, "payload_bytes": len(payload), "tokens": len(stored),
            "pixel_values": list(sample.pixel_values.shape)}
