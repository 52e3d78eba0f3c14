"""Strict validation of the engine's /generate body (DESIGN.md 5.3): every well-formed payload passes,
every single-rule corruption is a 502 naming the rule, and nothing reaches the trajectory."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.tito import engine_body
from trajectory import LinearTrajectory, decode_generate_response
from trajectory.errors import UpstreamError

VOCAB = 1000


def dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


@st.composite
def payloads(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 40))
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    logprobs = draw(st.lists(st.floats(-1e30, 0.0) | st.integers(-50, 0), min_size=n, max_size=n))
    finish = draw(st.sampled_from([
        {"type": "stop", "matched": ids[-1] if ids else None}, {"type": "stop", "matched": "</answer>"},
        {"type": "stop"}, {"type": "length", "length": n}, {"type": "abort", "message": "client gone"},
        {"type": "abort", "message": None, "status_code": 499},
    ]))
    body = engine_body(ids, logprobs, finish=finish, prompt_tokens=draw(st.integers(0, 10**6)), text="t",
                       rid=draw(st.text(max_size=8)))
    entries = body["meta_info"]["output_token_logprobs"]
    # SGLang's own shape is [logprob, id, null] (decoded as plain tuples); [logprob, id] and [logprob, id, text] are
    # allowed too (decoded by the full schema): a body may mix them.
    shapes = draw(st.sampled_from(["sglang", "mixed"]))
    for i in range(n):
        entries[i] = [*entries[i][:2], None]
        if shapes == "mixed":
            entries[i] = draw(st.sampled_from([entries[i], entries[i][:2], [*entries[i][:2], "tok"]]))
    meta = body["meta_info"]
    if draw(st.booleans()):
        meta["routed_experts"] = draw(st.lists(st.lists(st.integers(0, 255), max_size=4), max_size=4))
    if draw(st.booleans()):
        meta["some_future_field"] = {"nested": [1, 2]}
        body["another_unknown"] = None
    if draw(st.booleans()):
        del meta["cached_tokens"], meta["weight_version"], meta["e2e_latency"], meta["id"]
    return body


@settings(max_examples=examples(200), deadline=None)
@given(body=payloads())
def test_accepts_every_well_formed_payload(body):
    result = decode_generate_response(dumps(body), VOCAB)
    meta = body["meta_info"]
    assert result.output_ids.dtype == np.int32 and result.logprobs.dtype == np.float32
    assert result.output_ids.tolist() == body["output_ids"]
    expected = np.array([e[0] for e in meta["output_token_logprobs"]], dtype=np.float32)
    assert np.array_equal(result.logprobs, expected)
    assert result.completion_tokens == len(body["output_ids"]) and result.prompt_tokens == meta["prompt_tokens"]
    assert result.finish_reason["type"] == meta["finish_reason"]["type"]
    assert result.cached_tokens == meta.get("cached_tokens", 0) and result.rid == meta.get("id")
    if "routed_experts" in meta:
        assert json.loads(result.routed_experts) == meta["routed_experts"]
    else:
        assert result.routed_experts is None


def _parent(body: dict, path: tuple) -> Any:
    """The container that holds `path`'s last key (the mutations below change one field of a valid body)."""
    target = body
    for key in path[:-1]:
        target = target[key]
    return target


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def apply(body: dict) -> None:
        _parent(body, path)[path[-1]] = value
    return apply


def _delete(path: tuple) -> Callable[[dict], None]:
    def apply(body: dict) -> None:
        del _parent(body, path)[path[-1]]
    return apply


M, LP = ("meta_info",), ("meta_info", "output_token_logprobs")
# (name, corruption, rule): each breaks exactly one rule of DESIGN 5.3 on a valid 3-token payload.
CORRUPTIONS: list[tuple[str, Callable[[dict], None], str]] = [
    ("bool id in output_ids", _set(("output_ids", 1), True), "output_ids"),
    ("str id in output_ids", _set(("output_ids", 1), "7"), "output_ids"),
    ("None id in output_ids", _set(("output_ids", 1), None), "output_ids"),
    ("float id in output_ids", _set(("output_ids", 1), 7.0), "output_ids"),
    ("bool token id", _set((*LP, 1, 1), True), "token_id_type"),
    ("str token id", _set((*LP, 1, 1), "7"), "token_id_type"),
    ("None token id", _set((*LP, 1, 1), None), "token_id_type"),
    ("float token id", _set((*LP, 1, 1), 7.5), "token_id_type"),
    ("negative token id", lambda b: (_set((*LP, 1, 1), -1)(b), _set(("output_ids", 1), -1)(b)), "token_range"),
    ("token id == vocab", lambda b: (_set((*LP, 1, 1), VOCAB)(b), _set(("output_ids", 1), VOCAB)(b)), "token_range"),
    ("token id != output id", _set((*LP, 1, 1), 8), "token_mismatch"),
    ("str logprob", _set((*LP, 0, 0), "-0.1"), "logprob_value"),
    ("bool logprob", _set((*LP, 0, 0), False), "logprob_value"),
    ("None logprob", _set((*LP, 0, 0), None), "logprob_value"),
    ("overflowing logprob", _set((*LP, 0, 0), -1e39), "logprob_value"),
    ("entry of 1 item", _set((*LP, 2), [-0.1]), "logprob_entry"),
    ("entry of 4 items", _set((*LP, 2), [-0.1, 9, None, 0]), "logprob_entry"),
    ("entry not a list", _set((*LP, 2), {"logprob": -0.1}), "logprob_entry"),
    ("logprobs not a list", _set(LP, None), "output_token_logprobs"),
    ("logprobs too short", lambda b: b["meta_info"]["output_token_logprobs"].pop(), "length_mismatch"),
    ("output_ids too long", lambda b: b["output_ids"].append(5), "length_mismatch"),
    ("completion_tokens off", _set((*M, "completion_tokens"), 4), "length_mismatch"),
    ("completion_tokens bool", _set((*M, "completion_tokens"), True), "completion_tokens"),
    ("completion_tokens str", _set((*M, "completion_tokens"), "3"), "completion_tokens"),
    ("completion_tokens negative", _set((*M, "completion_tokens"), -3), "completion_tokens"),
    ("missing completion_tokens", _delete((*M, "completion_tokens")), "completion_tokens"),
    ("missing output_token_logprobs", _delete(LP), "output_token_logprobs"),
    ("missing output_ids", _delete(("output_ids",)), "output_ids"),
    ("missing meta_info", _delete(M), "meta_info"),
    ("meta_info not an object", _set(M, [1, 2]), "meta_info"),
    ("missing finish_reason", _delete((*M, "finish_reason")), "finish_reason"),
    ("finish_reason null", _set((*M, "finish_reason"), None), "finish_reason"),
    ("unknown finish type", _set((*M, "finish_reason"), {"type": "eos"}), "finish_reason"),
    ("length without length", _set((*M, "finish_reason"), {"type": "length"}), "finish_reason"),
    ("length with bool length", _set((*M, "finish_reason"), {"type": "length", "length": True}), "finish_reason"),
    ("stop with list matched", _set((*M, "finish_reason"), {"type": "stop", "matched": [1]}), "finish_reason"),
    ("abort without message", _set((*M, "finish_reason"), {"type": "abort"}), "finish_reason"),
    ("text not a string", _set(("text",), 3), "schema"),
    ("prompt_tokens missing", _delete((*M, "prompt_tokens")), "meta_info"),
    ("body not an object", lambda b: b.clear() or b.update({"__list__": True}), "schema"),
]


@pytest.fixture(scope="module")
def trajectory_with_a_turn(families) -> tuple[LinearTrajectory, Any]:
    family = families["qwen3"]
    traj = LinearTrajectory(family)
    plan = traj.prepare([{"role": "user", "content": "hi"}], None)
    ids = [*family.encode("Hello!"), family.eos_token_id]
    traj.commit(plan, decode_generate_response(dumps(engine_body(ids)), family.vocab_size),
                {"role": "assistant", "content": "Hello!"})
    return traj, traj.prepare([*traj.messages, {"role": "user", "content": "again"}], None)


def _snapshot(traj: LinearTrajectory) -> tuple:
    return traj.version, json.dumps(traj.to_dict()), traj.logprobs.tobytes(), traj.loss_mask.tobytes()


@pytest.mark.parametrize(("name", "corrupt", "rule"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_rejects_each_single_rule_corruption(trajectory_with_a_turn, name, corrupt, rule):
    traj, _ = trajectory_with_a_turn
    before = _snapshot(traj)
    body = engine_body([5, 6, 7], [-0.5, -1, 0.0], finish={"type": "stop", "matched": 7})
    assert decode_generate_response(dumps(body), VOCAB).output_ids.tolist() == [5, 6, 7]
    body = copy.deepcopy(body)
    corrupt(body)
    payload = dumps([1, 2]) if "__list__" in body else dumps(body)
    with pytest.raises(UpstreamError) as info:
        decode_generate_response(payload, VOCAB)
    assert (info.value.rule, info.value.status) == (rule, 502), info.value.message
    assert _snapshot(traj) == before


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_rejects_non_finite_json_literals(literal):
    payload = dumps(engine_body([5], [-0.5])).replace(b"-0.5", literal)
    assert literal in payload
    with pytest.raises(UpstreamError) as info:
        decode_generate_response(payload, VOCAB)
    assert info.value.rule == "json"


def test_malformed_json_after_an_entry_of_another_shape_is_a_502():
    """The plain decode stops at the 2-item entry without reading on; the full decode then meets the NaN literal
    (it was let out as msgspec's own DecodeError, which the server answers with a 500)."""
    body = engine_body([5, 6], [-0.5, -0.25])
    body["meta_info"]["output_token_logprobs"][1] = [-0.25, 6]
    payload = dumps(body).replace(b'"e2e_latency": 0.01', b'"e2e_latency": NaN')
    with pytest.raises(UpstreamError) as info:
        decode_generate_response(payload, VOCAB)
    assert (info.value.rule, info.value.status) == ("json", 502)


@pytest.mark.parametrize("payload", [b"", b"{", b"not json", dumps(engine_body([1])) + b" trailing"])
def test_rejects_malformed_json(payload):
    with pytest.raises(UpstreamError) as info:
        decode_generate_response(payload, VOCAB)
    assert info.value.rule == "json"


def test_routed_experts_are_kept_raw_and_large_payloads_decode(hf_tokenizers):
    experts = [[[i % 256, (i * 7) % 256] for i in range(8)] for _ in range(20_000)]
    body = engine_body([1, 2], [-0.1, -0.2], routed_experts=experts)
    result = decode_generate_response(dumps(body), VOCAB)
    assert result.routed_experts is not None and len(result.routed_experts) > 1_000_000
    assert json.loads(result.routed_experts) == experts
    assert decode_generate_response(dumps(engine_body([1], routed_experts=None)), VOCAB).routed_experts is None


def test_finish_reason_shapes_are_normalised():
    for finish, expected in [
        ({"type": "stop", "matched": 7}, {"type": "stop", "matched": 7}),
        ({"type": "stop"}, {"type": "stop", "matched": None}),
        ({"type": "length", "length": 1}, {"type": "length", "length": 1}),
        ({"type": "abort", "message": "m", "err_type": "x"}, {"type": "abort", "message": "m"}),
    ]:
        assert decode_generate_response(dumps(engine_body([7], finish=finish)), VOCAB).finish_reason == expected


def test_logprobs_are_float32_and_finite():
    result = decode_generate_response(dumps(engine_body([1, 2], [-1e-40, -3])), VOCAB)
    assert result.logprobs.tolist() == [np.float32(-1e-40), -3.0]
    assert all(math.isfinite(x) for x in result.logprobs.tolist())
