"""frontend/images.py: every API's image parts read and checked by one set of rules, each refusal a 400 that names the
field; and the Responses and Anthropic image shapes map onto the chat image part."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image as PILImage

from session_server.frontend.images import read_image, read_images
from session_server.messages.protocol import parse_messages
from session_server.responses.protocol import parse_responses
from trajectory.errors import RequestValidationError
from trajectory.images import Image, ImageLimits, image_digest

LIMITS = ImageLimits()


def png(width: int = 32, height: int = 24, color: tuple[int, int, int] = (1, 2, 3)) -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring `width` x `height` with a tiny (truncated) body: what a decompression bomb's
    header says, without the gigabytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + \
        chunk(b"IEND", b"")


def test_a_data_url_is_read_with_its_real_type_and_size() -> None:
    data = png(320, 240)
    image = read_image("x", data_url(data, "image/jpeg"), LIMITS)  # the client's type is not trusted
    assert (image.width, image.height, image.mime, image.digest) == (320, 240, "image/png", image_digest(data))
    assert image.data == data and image.data_url() == data_url(data)


@pytest.mark.parametrize(("url", "limits", "why"), [
    ("https://example.com/a.png", LIMITS, "remote URL"),
    ("file:///etc/passwd", LIMITS, "data URL"),
    ("data:image/png,abc", LIMITS, "base64 data URL"),
    ("data:image/png;base64,%%%", LIMITS, "not valid base64"),
    (data_url(b"hello, not an image"), LIMITS, "not an image"),
    (data_url(png()[:60]), LIMITS, "not a readable image"),
    (data_url(png(64, 64)), ImageLimits(max_pixels=64 * 63), "64x64 pixels"),
    (data_url(bomb(100_000, 100_000)), LIMITS, "more pixels than the 16777216 allowed"),
    (data_url(bomb(5000, 5000)), LIMITS, "5000x5000 pixels, more than the 16777216 allowed"),
    (data_url(png()), ImageLimits(max_bytes=50), "larger than 50 bytes"),
    (3, LIMITS, "non-empty URL string"),
])
def test_bad_images_are_400s_naming_the_field(url: Any, limits: ImageLimits, why: str) -> None:
    with pytest.raises(RequestValidationError, match=f"^'messages\\[0\\].content\\[1\\]' .*{why}"):
        read_image("messages[0].content[1]", url, limits)


def test_a_bomb_is_refused_before_decoding() -> None:
    """The header alone refuses it: a declared 1e10 pixels would take PIL tens of gigabytes to decode."""
    with pytest.raises(RequestValidationError, match="pixels"):
        read_image("x", data_url(bomb(100_000, 100_000)), LIMITS)


def test_read_images_converts_only_image_parts_and_counts_them() -> None:
    text = {"role": "user", "content": "plain"}
    one = {"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "image_url", "image_url": {"url": data_url(png())}}]}
    out = read_images([text, one], LIMITS, True, "qwen3-vl")
    assert out[0] is text
    assert out[1]["content"][0] == {"type": "text", "text": "a"} and isinstance(out[1]["content"][1]["image"], Image)
    assert read_images([text], LIMITS, True, "qwen3-vl")[0] is text
    with pytest.raises(RequestValidationError, match=r"'messages\[1\].content\[1\]' is image 2: .* at most 1"):
        read_images([one, one], ImageLimits(max_images=1), True, "qwen3-vl")
    with pytest.raises(RequestValidationError, match=r"'messages\[1\].content\[1\].type' .*qwen3 takes text only"):
        read_images([text, one], LIMITS, False, "qwen3")


def test_a_known_image_is_not_decoded_again() -> None:
    data = png()
    known = {image_digest(data): Image(image_digest(data), data, 7, 7, "image/png")}
    assert read_image("x", data_url(data), LIMITS, known).width == 7


@pytest.fixture
def served() -> Iterator[str]:
    """A loopback HTTP server: /ok.png is a picture, /big.png more bytes than the limit, /slow never answers."""
    picture = png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/slow":
                threading.Event().wait(3)
                return
            body = picture if self.path == "/ok.png" else b"x" * 5000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_fetching_is_allowed_only_by_the_operator_and_bounded(served: str) -> None:
    allowed = ImageLimits(fetch=True, max_bytes=4000, fetch_timeout=0.3)
    with pytest.raises(RequestValidationError, match="remote URL"):
        read_image("x", f"{served}/ok.png", LIMITS)
    assert read_image("x", f"{served}/ok.png", allowed).mime == "image/png"
    with pytest.raises(RequestValidationError, match="larger than 4000 bytes"):
        read_image("x", f"{served}/big.png", allowed)
    with pytest.raises(RequestValidationError, match="could not be fetched"):  # 0.3 s against a 3 s stall
        read_image("x", f"{served}/slow", allowed)


def test_responses_and_anthropic_images_map_onto_the_chat_part() -> None:
    url = data_url(png())
    mapped = parse_responses({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": url, "detail": "auto"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": url}]}]},
        "enable_thinking")
    user, _, tool = mapped.chat["messages"]
    assert user["content"] == [{"type": "text", "text": "see"},
                               {"type": "image_url", "image_url": {"url": url}, "where": "input[0].content[1]"}]
    assert tool["content"][0]["image_url"] == {"url": url}
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]}}
    turn = parse_messages({"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "see"}, block]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [block]}]}]},
        "enable_thinking")
    user, _, tool = turn.chat["messages"]
    assert user["content"][1] == {"type": "image_url", "image_url": {"url": url}, "where": "messages[0].content[1]"}
    assert tool["content"][0]["where"] == "messages[2].content[0].content[0]"
