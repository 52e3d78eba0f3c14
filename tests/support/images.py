"""Images for the image tests (sim and real engine): PNG/JPEG bytes drawn with PIL, data URLs, Qwen3 prompts with
one `<|vision_start|><|image_pad|><|vision_end|>` per image, and the wire facts of `image_data` as checks both tiers
run (the values must agree, not only the shapes: the session server stores what the engine returns)."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from PIL import Image

from trajectory.image_grid import IMAGE_PAD_ID, image_token_count
from trajectory.images import collapse, runs

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def png(width: int, height: int, color: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    """A solid `width`x`height` image, encoded as `fmt`."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def pad_runs(ids: Sequence[int], pad: int = IMAGE_PAD_ID) -> list[tuple[int, int]]:
    """(start, length) of each image's run of pads, read as the server reads them (trajectory.images.runs)."""
    return [(a, b - a) for a, b in runs(np.asarray(ids), pad)]


def collapse_pads(ids: Sequence[int], pad: int = IMAGE_PAD_ID) -> list[int]:
    """Each run of pads as one pad: what the server sends SGLang (trajectory.images.collapse)."""
    return [int(i) for i in collapse(np.asarray(ids), pad)]


def user_turn(content: str) -> str:
    """A Qwen3 user message and the assistant header, as the chat template renders them."""
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


RED = png(320, 240, (200, 30, 60))  # resized to 320x256: a 16x20 patch grid, 80 pads
TALL = png(100, 500, (10, 200, 60))  # resized to 128x576: 8x36, 72 pads


# -- the wire facts of images, checked on the sim (tests/e2e/test_sim_images.py) and on real SGLang 0.5.23
# (tests/sglang/test_real_images_wire.py) alike: each takes a client of a freshly flushed engine and the tokenizer's
# encode.

Encode = Callable[[str], list[int]]


def generate(client: httpx.Client, input_ids: list[int], images: Any, **extra: Any) -> httpx.Response:
    """A greedy 8-token /generate that asks for the expanded prompt ids."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_prompt_token_ids": True, **extra}
    if images is not None:
        body["image_data"] = images
    return client.post("/generate", json=body)


def stream_events(client: httpx.Client, body: dict[str, Any]) -> tuple[int, list[bytes]]:
    """A streamed /generate: its status and its `\\n\\n`-separated blocks (the last one empty)."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        return r.status_code, r.read().split(b"\n\n")


def one_pad_in_expanded_ids_out(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}What is this?"))
    r = generate(client, prompt, data_url(RED))
    assert r.status_code == 200, r.text
    body = r.json()
    expanded = body["prompt_token_ids"]
    assert image_token_count(240, 320) == 80
    assert pad_runs(expanded) == [(prompt.index(IMAGE_PAD_ID), 80)]
    assert collapse_pads(expanded) == prompt
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(expanded) == len(prompt) + 79
    assert meta["image_tokens"] == 80 and meta["cached_tokens"] == 0
    assert list(meta).index("image_tokens") == list(meta).index("cached_tokens_details") + 1


def same_image_is_a_cache_hit_whatever_its_encoding(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}What is this?"))
    first = generate(client, prompt, data_url(RED)).json()
    again = generate(client, prompt, [base64.b64encode(RED).decode()]).json()  # bare base64, in a list
    n = len(first["prompt_token_ids"])
    assert again["prompt_token_ids"] == first["prompt_token_ids"]
    assert again["meta_info"]["cached_tokens"] == n - 1
    other = generate(client, prompt, data_url(png(320, 240, (0, 0, 255)))).json()
    assert other["meta_info"]["cached_tokens"] == prompt.index(IMAGE_PAD_ID)  # a miss from the first pad on


def second_turn_collapses_runs_and_sends_every_image_in_order(client: httpx.Client, encode: Encode) -> None:
    first = generate(client, encode(user_turn(f"{IMG}What is this?")), data_url(RED)).json()
    stored = first["prompt_token_ids"] + first["output_ids"]
    turn2 = collapse_pads(stored) + encode(f"<|im_end|>\n{user_turn(f'{IMG}And this?')}")
    second = generate(client, turn2, [data_url(RED), data_url(TALL)]).json()
    expanded = second["prompt_token_ids"]
    assert expanded[: len(stored)] == stored
    assert [n for _, n in pad_runs(expanded)] == [80, 72]
    assert second["meta_info"]["image_tokens"] == 152
    assert second["meta_info"]["cached_tokens"] == len(stored) - 1
    swapped = generate(client, turn2, [data_url(TALL), data_url(RED)]).json()
    assert swapped["meta_info"]["cached_tokens"] == turn2.index(IMAGE_PAD_ID)


def alone(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    """A /generate on a connection of its own: after a 500 the engine closes the connection (uvicorn, on the
    exception), and a pooled client's next request would be reset."""
    with httpx.Client(base_url=client.base_url, timeout=client.timeout) as once:
        return once.post("/generate", json=body)


def pipelined_statuses(client: httpx.Client, body: dict[str, Any]) -> list[int]:
    """The statuses answered on ONE connection to a /generate of `body` with a `GET /model_info` pipelined behind
    it (HTTP/1.1), read until the engine closes the connection: [status, 200] if it keeps the connection, [status]
    if it closes it after the first answer."""
    url = client.base_url
    payload = json.dumps(body).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")
    second = f"GET /model_info HTTP/1.1\r\nHost: {url.host}\r\n\r\n"
    data = b""
    with socket.create_connection((url.host, url.port or 80), timeout=300) as sock:
        sock.sendall(head.encode() + payload + second.encode())
        while chunk := sock.recv(1 << 16):  # an engine that keeps the connection closes it when idle (keep-alive)
            data += chunk
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]  # a response follows a body directly


def more_pads_than_images_is_a_500(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}What is this?"))
    expanded = generate(client, prompt, data_url(RED)).json()["prompt_token_ids"]
    two_pads = encode(user_turn(f"{IMG}a{IMG}b"))
    for input_ids in (expanded, two_pads):
        r = alone(client, {"input_ids": input_ids, "image_data": [data_url(RED)],
                           "sampling_params": {"max_new_tokens": 4}})
        assert (r.status_code, r.text) == (500, "Internal Server Error")
        assert r.headers["content-type"].startswith("text/plain") and "connection" not in r.headers
    crash = {"input_ids": expanded, "image_data": data_url(RED), "sampling_params": {"max_new_tokens": 4}}
    assert pipelined_statuses(client, crash) == [500]  # the connection closes after the 500
    assert pipelined_statuses(client, {**crash, "input_ids": prompt}) == [200, 200]
    with client.stream("POST", "/generate", json={**crash, "stream": True}) as r:
        assert r.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            r.read()
    assert generate(client, prompt, data_url(RED)).status_code == 200  # and the engine serves on


def fewer_pads_than_images_use_the_first_ones(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}What is this?"))
    r = generate(client, prompt, [data_url(TALL), data_url(RED)]).json()
    assert r["meta_info"]["image_tokens"] == 72 and len(r["prompt_token_ids"]) == len(prompt) + 71
    plain = encode(user_turn("no image here"))
    r = generate(client, plain, [data_url(RED)]).json()
    assert r["prompt_token_ids"] == plain and "image_tokens" not in r["meta_info"]
    for nothing in ([], None):  # no images: the pad is an ordinary token
        r = generate(client, prompt, nothing).json()
        assert r["prompt_token_ids"] == prompt and "image_tokens" not in r["meta_info"]
    r = generate(client, prompt, None, return_prompt_token_ids=False).json()
    assert "prompt_token_ids" not in r


def grid_arithmetic_for_other_sizes_and_formats(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}x"))
    for width, height, fmt in ((64, 64, "JPEG"), (10, 10, "PNG"), (1000, 700, "PNG"), (33, 999, "PNG")):
        data = png(width, height, (5, 90, 5), fmt)
        r = generate(client, prompt, data_url(data, f"image/{fmt.lower()}")).json()
        assert r["meta_info"]["image_tokens"] == image_token_count(height, width), (width, height)
    assert [image_token_count(h, w) for w, h in ((64, 64), (10, 10), (1000, 700))] == [64, 64, 682]


def bad_images_are_refused(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}x"))
    for image, message in (("not an image at all", "Non-base64 digit found"),
                           ("data:image/png;base64,!!!!", "Non-base64 digit found"),
                           (base64.b64encode(b"hello world!").decode(),
                            "Could not decode image: cannot identify image file <_io.BytesIO object at 0x")):
        r = generate(client, prompt, image)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
        assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message"}
        status, blocks = stream_events(client, {"input_ids": prompt, "image_data": image})
        assert status == 200 and blocks[1:] == [b"data: [DONE]", b""], blocks
        error = msgspec.json.decode(blocks[0].removeprefix(b"data: "))["error"]
        assert error["code"] == 400 and error["message"].startswith(message)
        assert error["type"] == "invalid_request_error" and error["retryable"] is False
    r = generate(client, prompt, 5)
    assert (r.status_code, r.json()) == (400, {"error": "invalid type: integer `5`, expected one of the MediaInput "
                                                        "shapes"})
    r = generate(client, prompt, ["x", 5])
    assert (r.status_code, r.json()) == (400, {"error": "invalid type: integer `5`, expected one of the MediaItem "
                                                        "shapes"})
    r = generate(client, prompt, None, return_prompt_token_ids="yes")
    assert (r.status_code, r.json()) == (400, {"error": 'invalid type: string "yes", expected a boolean'})


def streamed_image_request_carries_the_prompt_ids_in_every_event(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}What is this?"))
    status, blocks = stream_events(client, {"input_ids": prompt, "image_data": data_url(RED),
                                            "return_prompt_token_ids": True,
                                            "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert status == 200 and blocks[-2:] == [b"data: [DONE]", b""]
    events = [msgspec.json.decode(b.removeprefix(b"data: ")) for b in blocks[:-2]]
    for event in events:
        assert len(event["prompt_token_ids"]) == len(prompt) + 79
        assert event["meta_info"]["image_tokens"] == 80
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def input_logprobs_report_image_pads_as_id_zero(client: httpx.Client, encode: Encode) -> None:
    prompt = encode(user_turn(f"{IMG}What is this?"))
    r = generate(client, prompt, data_url(RED), return_logprob=True, logprob_start_len=0).json()
    reported = [entry[1] for entry in r["meta_info"]["input_token_logprobs"]]
    assert reported == [0 if t == IMAGE_PAD_ID else t for t in r["prompt_token_ids"]]


CHECKS = [one_pad_in_expanded_ids_out, same_image_is_a_cache_hit_whatever_its_encoding,
          second_turn_collapses_runs_and_sends_every_image_in_order, more_pads_than_images_is_a_500,
          fewer_pads_than_images_use_the_first_ones, grid_arithmetic_for_other_sizes_and_formats,
          bad_images_are_refused, streamed_image_request_carries_the_prompt_ids_in_every_event,
          input_logprobs_report_image_pads_as_id_zero]
