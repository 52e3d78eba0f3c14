"""sglang-sim over real HTTP with `image_data`: the rules SGLang 0.5.23 follows for a Qwen3-VL checkpoint
(tests/sglang/test_real_images_wire.py pins them on the real engine; the differential test holds the shapes).

One `<|image_pad|>` per image goes in, the expanded prompt comes back (`return_prompt_token_ids`), more pads than
images is SGLang's 500, and the radix cache tells images apart by content.
"""

from __future__ import annotations

import base64
import io

import httpx
import msgspec
import pytest
from PIL import Image

from rollout.processes import start_sim
from support.sim import assert_baseline
from trajectory.image_grid import IMAGE_PAD_ID, collapse_pads, image_token_count, pad_runs

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
NO_MEDIA_SHAPE = "invalid type: integer `5`, expected one of the MediaInput shapes"


def png(width: int, height: int, color: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


RED = png(320, 240, (200, 30, 60))  # 80 pads
TALL = png(100, 500, (10, 200, 60))  # 72 pads


@pytest.fixture(scope="module")
def sim(tokenizer_dirs, hf_tokenizers, tmp_path_factory):
    # The Qwen3 tokenizer directory has no preprocessor_config.json: the sim resizes as the published Qwen3-VL does.
    args = ("--context-length", "4096", "--kv-capacity-tokens", "20000", "--token-latency-ms", "5")
    with start_sim(tokenizer_dirs["qwen3"], "qwen3", *args, log_dir=tmp_path_factory.mktemp("sim")) as proc, \
            httpx.Client(base_url=proc.url, timeout=60) as client:
        yield client, hf_tokenizers["qwen3"]
        assert_baseline(client)


@pytest.fixture
def client(sim):
    client, _ = sim
    assert client.post("/flush_cache").status_code == 200
    yield client
    assert_baseline(client)


@pytest.fixture
def ids(sim):
    _, tok = sim

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    return encode


def user_turn(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def generate(client: httpx.Client, input_ids: list[int], images, **extra) -> httpx.Response:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_prompt_token_ids": True, **extra}
    if images is not None:
        body["image_data"] = images
    return client.post("/generate", json=body)


def test_one_pad_in_expanded_ids_out(client, ids):
    prompt = ids(user_turn(f"{IMG}What is this?"))
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


def test_the_same_image_is_a_cache_hit_whatever_its_encoding(client, ids):
    prompt = ids(user_turn(f"{IMG}What is this?"))
    first = generate(client, prompt, data_url(RED)).json()
    again = generate(client, prompt, [base64.b64encode(RED).decode()]).json()  # bare base64, in a list
    n = len(first["prompt_token_ids"])
    assert again["prompt_token_ids"] == first["prompt_token_ids"]
    assert again["meta_info"]["cached_tokens"] == n - 1
    other = generate(client, prompt, data_url(png(320, 240, (0, 0, 255)))).json()
    assert other["meta_info"]["cached_tokens"] == prompt.index(IMAGE_PAD_ID)  # a miss from the first pad on
    assert other["output_ids"] != first["output_ids"]  # another image, another reply


def test_a_second_turn_collapses_runs_and_sends_every_image_in_order(client, ids):
    first = generate(client, ids(user_turn(f"{IMG}What is this?")), data_url(RED)).json()
    stored = first["prompt_token_ids"] + first["output_ids"]
    turn2 = collapse_pads(stored) + ids(f"<|im_end|>\n{user_turn(f'{IMG}And this?')}")
    second = generate(client, turn2, [data_url(RED), data_url(TALL)]).json()
    expanded = second["prompt_token_ids"]
    assert expanded[: len(stored)] == stored
    assert [n for _, n in pad_runs(expanded)] == [80, 72]
    assert second["meta_info"]["image_tokens"] == 152
    assert second["meta_info"]["cached_tokens"] == len(stored) - 1
    swapped = generate(client, turn2, [data_url(TALL), data_url(RED)]).json()
    assert swapped["meta_info"]["cached_tokens"] == turn2.index(IMAGE_PAD_ID)


def test_more_pads_than_images_is_sglangs_500(client, ids):
    prompt = ids(user_turn(f"{IMG}What is this?"))
    expanded = generate(client, prompt, data_url(RED)).json()["prompt_token_ids"]
    two_pads = ids(user_turn(f"{IMG}a{IMG}b"))
    for input_ids in (expanded, two_pads):
        r = generate(client, input_ids, [data_url(RED)])
        assert (r.status_code, r.text) == (500, "Internal Server Error")
        assert r.headers["content-type"].startswith("text/plain")
    with client.stream("POST", "/generate", json={"input_ids": expanded, "image_data": data_url(RED),
                                                  "stream": True}) as r:
        assert r.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            r.read()


def test_fewer_pads_than_images_use_the_first_ones(client, ids):
    prompt = ids(user_turn(f"{IMG}What is this?"))
    r = generate(client, prompt, [data_url(TALL), data_url(RED)]).json()
    assert r["meta_info"]["image_tokens"] == 72
    plain = ids(user_turn("no image here"))
    r = generate(client, plain, [data_url(RED)]).json()
    assert r["prompt_token_ids"] == plain and "image_tokens" not in r["meta_info"]
    r = generate(client, prompt, []).json()  # no images: the pad is an ordinary token
    assert r["prompt_token_ids"] == prompt and "image_tokens" not in r["meta_info"]


def test_grid_arithmetic_for_other_sizes_and_formats(client, ids):
    prompt = ids(user_turn(f"{IMG}x"))
    for data, mime, pads in ((png(64, 64, (1, 2, 3), "JPEG"), "image/jpeg", 64), (png(10, 10, (9, 9, 9)), None, 64),
                             (png(1000, 700, (5, 5, 5)), None, image_token_count(700, 1000))):
        r = generate(client, prompt, data_url(data, mime or "image/png")).json()
        assert r["meta_info"]["image_tokens"] == pads
    assert image_token_count(700, 1000) == 682  # resized to 704x992: 44x62 patches, 4 to a pad


def test_bad_images_are_refused_like_sglang(client, ids):
    prompt = ids(user_turn(f"{IMG}x"))
    for image, message in (("not an image at all", "Non-base64 digit found"),
                           ("data:image/png;base64,!!!!", "Non-base64 digit found"),
                           (base64.b64encode(b"hello world!").decode(), "Could not decode image: cannot identify")):
        r = generate(client, prompt, image)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
        with client.stream("POST", "/generate", json={"input_ids": prompt, "image_data": image,
                                                      "stream": True}) as s:
            events = s.read().split(b"\n\n")
        assert s.status_code == 200 and events[1:] == [b"data: [DONE]", b""]
        error = msgspec.json.decode(events[0].removeprefix(b"data: "))["error"]
        assert error["code"] == 400 and error["message"].startswith(message)
    r = generate(client, prompt, 5)
    assert (r.status_code, r.json()) == (400, {"error": NO_MEDIA_SHAPE})
    r = generate(client, prompt, ["x", 5])
    assert r.json() == {"error": "invalid type: integer `5`, expected one of the MediaItem shapes"}
    assert generate(client, prompt, "http://127.0.0.1:9/x.png").status_code == 500  # SGLang's failed fetch


def test_a_streamed_image_request_carries_the_prompt_ids_in_every_event(client, ids):
    prompt = ids(user_turn(f"{IMG}What is this?"))
    with client.stream("POST", "/generate", json={
            "input_ids": prompt, "image_data": data_url(RED), "return_prompt_token_ids": True, "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as r:
        blocks = r.read().split(b"\n\n")
    assert blocks[-2:] == [b"data: [DONE]", b""]
    events = [msgspec.json.decode(b.removeprefix(b"data: ")) for b in blocks[:-2]]
    assert len(events) > 1
    for event in events:
        assert len(event["prompt_token_ids"]) == len(prompt) + 79
        assert event["meta_info"]["image_tokens"] == 80
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_input_logprobs_report_image_pads_as_id_zero(client, ids):
    prompt = ids(user_turn(f"{IMG}What is this?"))
    r = generate(client, prompt, data_url(RED), return_logprob=True, logprob_start_len=0).json()
    reported = [entry[1] for entry in r["meta_info"]["input_token_logprobs"]]
    expected = [0 if t == IMAGE_PAD_ID else t for t in r["prompt_token_ids"]]
    assert reported == expected


def test_images_on_engine_sessions_are_refused_plainly(client, ids):
    session = client.post("/open_session", json={"capacity_of_str_len": 10000}).json()
    try:
        r = generate(client, ids(user_turn(f"{IMG}x")), data_url(RED), session_params={"id": session})
        assert r.status_code == 400 and "does not emulate image_data on engine sessions" in r.text
    finally:
        assert client.post("/close_session", json={"session_id": session}).status_code == 200
