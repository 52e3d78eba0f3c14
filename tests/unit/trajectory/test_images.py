"""trajectory/images.py and images through TITO: stored tokens hold each image's expanded run (mask 0), the engine gets
each run collapsed to one pad plus every image of the prompt in order, and matching, rollback and the engine's own
count of image tokens are held to that."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image as PILImage

from trajectory import (
    GenerateResult,
    LinearTrajectory,
    build_merged_sample,
    samples_from_json,
    samples_from_safetensors,
    samples_to_json,
    samples_to_safetensors,
    truncate_sample,
)
from trajectory.errors import RequestValidationError, UpstreamError
from trajectory.families.qwen3_vl import Qwen3VLFamily
from trajectory.image_grid import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from trajectory.images import IMAGE_MARK, Image, collapse, expand, image_digest, mrope_positions, runs

PAD = IMAGE_PAD_ID


def picture(width: int, height: int, color: tuple[int, int, int] = (10, 20, 30)) -> Image:
    buffer = io.BytesIO()
    PILImage.new("RGB", (width, height), color).save(buffer, "PNG")
    data = buffer.getvalue()
    return Image(image_digest(data), data, width, height, "image/png")


def user(*parts: str | Image) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image", "image": p} if isinstance(p, Image) else
                                        {"type": "text", "text": p} for p in parts]}


def reply(prompt_len: int, ids: list[int], text: str = "ok") -> GenerateResult:
    return GenerateResult(text=text, output_ids=np.asarray(ids, np.int32),
                          logprobs=np.full(len(ids), -0.5, np.float32),
                          finish_reason={"type": "stop", "matched": ids[-1]},
                          prompt_tokens=prompt_len, completion_tokens=len(ids))


@pytest.fixture(scope="module")
def vl(families: dict[str, Any]) -> Qwen3VLFamily:
    """The suite's Qwen3-VL, bound once per test process (to Qwen3's vocabulary), not once more here."""
    family = families["qwen3-vl"]
    assert isinstance(family, Qwen3VLFamily)
    return family


@given(st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=4), st.integers(1, 6)), max_size=6),
       st.lists(st.integers(0, 5), max_size=4))
def test_expand_then_collapse_is_identity(images: list[tuple[list[int], int]], tail: list[int]) -> None:
    """A prompt with one pad per image (between its markers), expanded and collapsed, is itself; its runs are the
    images' spans, of the lengths asked for."""
    single = np.asarray([t for text, _ in images for t in [*text, VISION_START_ID, PAD, VISION_END_ID]] + tail,
                        np.int32)
    counts = [count for _, count in images]
    expanded = expand(single, PAD, counts)
    assert [b - a for a, b in runs(expanded, PAD)] == counts
    assert np.array_equal(collapse(expanded, PAD), single)


def test_first_turn_stores_the_expanded_run(vl: Qwen3VLFamily) -> None:
    """A 320x240 image is 80 pads (SGLang's and transformers' count); the engine gets one pad between the markers."""
    image = picture(320, 240)
    plan = LinearTrajectory(vl).prepare([user("look ", image, " here")])
    ((start, end),) = runs(plan.prompt_ids, PAD)
    assert end - start == 80
    assert plan.prompt_ids[start - 1] == VISION_START_ID and plan.prompt_ids[end] == VISION_END_ID
    assert plan.images == (image,)
    assert plan.messages[0] == {"role": "user", "content": f"look {IMAGE_MARK} here", "images": [image.digest]}
    assert vl.decode(collapse(plan.prompt_ids, PAD)).startswith(
        "<|im_start|>user\nlook <|vision_start|><|image_pad|><|vision_end|> here<|im_end|>")


def test_later_turns_extend_the_stored_ids_and_send_every_image(vl: Qwen3VLFamily) -> None:
    first, second, third = picture(320, 240), picture(640, 480, (200, 0, 0)), picture(300, 300, (0, 90, 0))
    traj = LinearTrajectory(vl)
    history: list[dict[str, Any]] = [user("a", first)]
    for image in (second, third):
        plan = traj.prepare(history)
        done = reply(len(plan.prompt_ids), vl.encode("ok<|im_end|>"))
        traj.commit(plan, done, {"role": "assistant", "content": "ok"})
        history += [{"role": "assistant", "content": "ok"}, user("next", image)]
    plan = traj.prepare(history)
    stored = traj.token_ids
    assert np.array_equal(plan.prompt_ids[: len(stored)], stored) and plan.new_token_start == len(stored)
    assert plan.images == (first, second, third)
    assert [b - a for a, b in runs(plan.prompt_ids, PAD)] == [vl.vision.count(i) for i in (first, second, third)]
    assert (traj.loss_mask[np.asarray(traj.token_ids) == PAD] == 0).all()
    # the engine's input: each run one pad, the markers around it, nothing else changed
    sent = collapse(plan.prompt_ids, PAD)
    assert int((sent == PAD).sum()) == 3 and len(sent) == len(plan.prompt_ids) - sum(
        b - a - 1 for a, b in runs(plan.prompt_ids, PAD))


def test_a_history_with_another_image_rolls_back(vl: Qwen3VLFamily) -> None:
    """The same text with a different picture is a different message: the turn after it is rolled back."""
    traj = LinearTrajectory(vl)
    plan = traj.prepare([user("a", picture(320, 240))])
    traj.commit(plan, reply(len(plan.prompt_ids), vl.encode("ok<|im_end|>")), {"role": "assistant", "content": "ok"})
    again = traj.prepare([user("a", picture(320, 240, (1, 1, 1)))])
    assert again.rolled_back == 1 and again.rollback_reason == "content" and again.new_token_start == 0
    same = traj.prepare([user("a", picture(320, 240)), {"role": "assistant", "content": "ok"}, user("b")])
    assert same.rolled_back == 0 and same.images == plan.images


def test_the_engine_must_expand_images_as_we_do(vl: Qwen3VLFamily) -> None:
    traj = LinearTrajectory(vl)
    plan = traj.prepare([user(picture(320, 240))])
    with pytest.raises(UpstreamError, match="expanded"):
        traj.commit(plan, reply(len(plan.prompt_ids) - 79, [1, 2]), {"role": "assistant", "content": "x"})
    assert traj.num_tokens == 0
    traj.commit(plan, reply(len(plan.prompt_ids), [1, 2]), {"role": "assistant", "content": "x"})
    assert traj.images == {plan.images[0].digest: plan.images[0]}


def test_refusals(vl: Qwen3VLFamily, families: dict[str, Any]) -> None:
    with pytest.raises(RequestValidationError, match="takes text only"):
        LinearTrajectory(families["qwen3"]).prepare([user("a", picture(320, 240))])
    with pytest.raises(RequestValidationError, match="U\\+FDD0"):
        LinearTrajectory(vl).prepare([user(f"a{IMAGE_MARK}", picture(320, 240))])
    with pytest.raises(RequestValidationError, match="aspect ratio"):
        LinearTrajectory(vl).prepare([user(picture(2000, 4))])
    # a spelled pad in text is text; under the engine's own rule it is the token, and then there is one too many
    spelled = [user("<|image_pad|>", picture(320, 240))]
    plan = LinearTrajectory(vl).prepare(spelled)
    assert len(runs(plan.prompt_ids, PAD)) == 1
    with pytest.raises(RequestValidationError, match="2 image placeholders for 1 images"):
        LinearTrajectory(vl, special_tokens="engine").prepare(spelled)


def test_a_mark_without_images_stays_text(vl: Qwen3VLFamily) -> None:
    plan = LinearTrajectory(vl).prepare([{"role": "user", "content": f"x{IMAGE_MARK}y"}])
    assert plan.images == () and IMAGE_MARK in vl.decode(plan.prompt_ids)


def test_samples_carry_each_image_span_hash_and_grid(vl: Qwen3VLFamily) -> None:
    """The merged sample names every image's pad run, hash and grid; pixel values travel in both codecs, and a
    truncation keeps an image whole or drops it with its pixels."""
    first, second = picture(320, 240), picture(100, 500, (9, 9, 9))
    traj = LinearTrajectory(vl)
    history: list[dict[str, Any]] = [user("a", first)]
    for image in (second, None):
        plan = traj.prepare(history)
        done = reply(len(plan.prompt_ids), vl.encode("ok<|im_end|>"))
        traj.commit(plan, done, {"role": "assistant", "content": "ok"})
        if image is not None:
            history += [{"role": "assistant", "content": "ok"}, user("b", image)]
    sample = build_merged_sample(traj)
    spans = [tuple(i["span"]) for i in sample.metadata["images"]]
    assert spans == runs(sample.tokens, PAD) and [e - s for s, e in spans] == [80, 72]
    assert [i["digest"] for i in sample.metadata["images"]] == [first.digest, second.digest]
    assert [i["image_grid_thw"] for i in sample.metadata["images"]] == [[1, 16, 20], [1, 36, 8]]
    assert (sample.loss_mask[spans[0][0]:spans[1][1]][sample.tokens[spans[0][0]:spans[1][1]] == PAD] == 0).all()
    grids = np.asarray([[1, 16, 20], [1, 36, 8]], np.int64)
    pixels = np.arange(int(grids.prod(axis=1).sum()) * 4, dtype=np.float32).reshape(-1, 4)
    sample = dataclasses.replace(sample, pixel_values=pixels, image_grid_thw=grids)
    assert sample.mrope_positions is not None and sample.mrope_positions.shape == (3, len(sample.tokens))
    for back in (samples_from_safetensors(samples_to_safetensors([sample]))[0],
                 samples_from_json(json.loads(json.dumps(samples_to_json([sample]))))[0]):
        assert np.array_equal(back.pixel_values, pixels) and np.array_equal(back.image_grid_thw, grids)
        assert back.metadata["images"] == sample.metadata["images"]
        assert np.array_equal(back.mrope_positions, sample.mrope_positions)
    cut = truncate_sample(sample, spans[1][0] + 5)  # inside the second run: it goes, with its pixels
    assert len(cut.tokens) <= spans[1][0] and [i["span"] for i in cut.metadata["images"]] == [list(spans[0])]
    assert np.array_equal(cut.image_grid_thw, grids[:1]) and len(cut.pixel_values) == 320
    assert np.array_equal(cut.mrope_positions, sample.mrope_positions[:, :len(cut.tokens)])
    with pytest.raises(ValueError, match="come together"):
        dataclasses.replace(sample, image_grid_thw=None)


def test_the_mismatch_report_sees_images_as_the_engine_expanded_them(vl: Qwen3VLFamily) -> None:
    """A canonical re-render of an image episode differs from the stored ids only inside assistant messages: its
    runs are expanded like the stored ones (collapsed, every run would be a template-glue difference)."""
    traj = LinearTrajectory(vl)
    history: list[dict[str, Any]] = [user("a", picture(320, 240))]
    for image in (picture(200, 300, (4, 4, 4)), None):
        plan = traj.prepare(history)
        done = reply(len(plan.prompt_ids), vl.encode("ok<|im_end|>"))
        traj.commit(plan, done, {"role": "assistant", "content": "ok"})
        if image is not None:
            history += [{"role": "assistant", "content": "ok"}, user("b", image)]
    report = traj.mismatch_report()
    assert "error" not in report and report["assistant_only"], report
    assert report["canonical_tokens"] - report["stored_tokens"] < 10


def test_qwen35_takes_images_in_its_own_vocabulary(families: dict[str, Any]) -> None:
    """Qwen3.5 is natively multimodal: its markers are its own ids, and its template renders the block in place."""
    family = families["qwen3.5"]
    assert family.vision is not None and (family.vision.tokens.start, family.vision.tokens.pad) == (248053, 248056)
    plan = LinearTrajectory(family).prepare([user("look ", picture(320, 240))])
    ((start, end),) = runs(plan.prompt_ids, 248056)
    assert end - start == 80 and plan.prompt_ids[start - 1] == 248053 and plan.prompt_ids[end] == 248054


def test_a_text_only_family_has_no_vision(families: dict[str, Any]) -> None:
    assert families["deepseek"].vision is None


@given(st.lists(st.tuples(st.integers(1, 6), st.sampled_from([(1, 16, 20), (1, 36, 8), (1, 16, 16), (1, 4, 6)])),
                min_size=1, max_size=4), st.integers(0, 6))
def test_mrope_positions_are_transformers_get_rope_index(layout: list[tuple[int, tuple[int, int, int]]],
                                                         tail: int) -> None:
    """The sample's mRoPE positions are those Qwen3-VL's own `get_rope_index` computes from the ids' image runs
    (runs never touch: each has its own markers around it)."""
    import types

    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    spans, grids, cursor = [], [], 0
    for text, grid in layout:
        start = cursor + text
        spans.append((start, start + grid[0] * grid[1] * grid[2] // 4))
        grids.append(grid)
        cursor = spans[-1][1]
    length = cursor + tail
    model = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=2)))
    model.get_vision_position_ids = lambda *a, **k: Qwen3VLModel.get_vision_position_ids(model, *a, **k)
    kinds = torch.zeros((1, length), dtype=torch.int32)
    for start, end in spans:
        kinds[0, start:end] = 1
    expected, _ = Qwen3VLModel.get_rope_index(model, torch.zeros((1, length), dtype=torch.long), kinds,
                                              torch.tensor(grids) if grids else None)
    assert np.array_equal(mrope_positions(length, spans, grids, 2), expected[:, 0].numpy())


def test_collapse_expand_and_runs_round_trip() -> None:
    p = IMAGE_PAD_ID
    single = np.array([1, 151652, p, 151653, 2, 151652, p, 151653, 3])
    expanded = expand(single, p, [3, 2])
    assert expanded.tolist() == [1, 151652, p, p, p, 151653, 2, 151652, p, p, 151653, 3]
    assert [(a, b - a) for a, b in runs(expanded, p)] == [(2, 3), (8, 2)]
    assert collapse(expanded, p).tolist() == single.tolist()
    assert expand(np.array([1, 2]), p, []).tolist() == [1, 2]
    with pytest.raises(RequestValidationError, match="2 image placeholders for 1 images"):
        expand(single, p, [80])
