"""Strict validation of the engine's /generate body (docs/design.md 5.3): every well-formed payload passes,
every single-rule corruption is a 502 naming the rule, and nothing reaches the trajectory."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import orjson
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.tito import engine_body
from trajectory import LinearTrajectory, decode_generate_response, engine_output
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
# (name, corruption, rule): each breaks exactly one rule of docs/design.md 5.3 on a valid 3-token payload.
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


# --- The fast path and the strict path agree on every body -------------------------------------------------------
# decode_generate_response first tries SGLang's own shape with the value rules written into the schema and falls
# back to the strict path (engine_output._decode_strictly, the decoder as it was before the fast path) whenever that
# does not fit. The strict path is the oracle: on any body, valid or broken, both give the same result bit for bit,
# or the same 502 with the same rule and message. Bodies are written as JSON text, so the spellings JSON allows (and
# some it does not) reach the decoder as an engine would send them.

_LOGPROB_SPELLINGS = [
    "-0.25", "-0", "-0.0", "0", "0.0", "-5", "1E5", "-1e-05", "-1.1920928955078125e-07", "-2.5E+3", "1e-45",
    "1e-46", "-3.4028234663852886e38", "3.4028234663852886e+38", "3.4028235677973366e38", "3.5e38", "-1e39",
    "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1" + "0" * 400, "true", "false", "null", '"-0.1"', "[]",
]
_ID_SPELLINGS = ["-0", "7.0", "7e0", "1E2", "true", "false", "null", '"7"', "-1", str(VOCAB), str(VOCAB - 1),
                 str(2**31), str(2**63), str(2**64), "1" + "0" * 30, "{}"]


def _spaced(draw: st.DrawFn, items: list[str], open_: str = "[", close: str = "]") -> str:
    """A JSON array of `items`, compact (SGLang's orjson) or with whitespace where JSON allows it."""
    if draw(st.booleans()):
        return open_ + ",".join(items) + close
    gap = draw(st.sampled_from([" ", "\n", "\t ", ""]))
    return open_ + gap + ("," + gap).join(items) + gap + close


_FAULTS = ["logprob", "token id", "entry shape", "output id", "count", "entries", "finish", "prompt_tokens",
           "a part", "top logprobs", "weight spans"]


@st.composite
def engine_texts(draw: st.DrawFn, fault: str | None = None) -> bytes:
    """A /generate body as text in SGLang's shape, with whitespace or not, and `fault` (a part respelled with a
    value JSON allows but the rules may not, or broken), sometimes with a second one."""
    faults = {fault, draw(st.sampled_from([None, None, *_FAULTS]))}
    n = draw(st.integers(0, 8))
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    floats = st.floats(allow_nan=False, allow_infinity=False, width=draw(st.sampled_from([32, 32, 64])))
    logprobs = [repr(draw(floats)) for _ in ids]
    id_texts, output_ids, thirds = [str(t) for t in ids], [str(t) for t in ids], [["null"] for _ in ids]
    at = draw(st.integers(0, max(n - 1, 0)))  # the token a token-level fault hits
    if n and "logprob" in faults:
        logprobs[at] = draw(st.sampled_from(_LOGPROB_SPELLINGS))
    if n and "token id" in faults:
        id_texts[at] = draw(st.sampled_from(_ID_SPELLINGS))
        output_ids[at] = draw(st.sampled_from([id_texts[at], output_ids[at]]))
    if n and "entry shape" in faults:
        thirds[at] = draw(st.sampled_from([[], ['"tok"'], ["null", "0"], ["1"], ["null", "null"]]))
    if n and "output id" in faults:
        output_ids[at] = draw(st.sampled_from([str(draw(st.integers(0, VOCAB - 1))), "-0", "0", "7.0"]))
    entries = [_spaced(draw, [lp, tid, *third]) for lp, tid, third in zip(logprobs, id_texts, thirds, strict=True)]
    if "entries" in faults:
        entries = entries[:-1] if entries and draw(st.booleans()) else [*entries, "[-0.5,1,null]"]
    count = str(n) if "count" not in faults else draw(st.sampled_from(
        [str(n + 1), str(max(n - 1, 0)), "true", f'"{n}"', "-1", f"{n}.0", None]))
    finish = draw(st.sampled_from([
        '{"type":"stop","matched":7}', '{"type":"length","length":3}', '{"type":"stop","matched":"</answer>"}',
        '{"type":"abort","message":"Aborted","status_code":null,"err_type":null}']))
    if "finish" in faults:
        finish = draw(st.sampled_from(['{"type":"stop","matched":"NaN happened"}', '{"type":"eos"}', "null"]))
    prompt = "12" if "prompt_tokens" not in faults else draw(st.sampled_from([None, "true", "-1"]))
    meta = {"id": '"r1"', "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": count,
            "cached_tokens": "0", "output_token_logprobs": _spaced(draw, entries), "weight_version": '"w0"',
            "e2e_latency": "0.01"}
    if draw(st.booleans()):
        spans = draw(st.sampled_from(["[]", f'[{{"version":"w0","start":1,"end":{n}}}]'])) if "weight spans" in faults \
            else f'[{{"version":"w0","start":0,"end":{n}}}]'
        meta["weight_versions"] = spans
    if draw(st.booleans()):
        row = draw(st.sampled_from(["[[NaN,3]]", "[[-0.5,1000]]", "[[1e39,3]]"])) if "top logprobs" in faults \
            else "[[-0.5,3,null]]"
        meta["output_top_logprobs"] = _spaced(draw, [draw(st.sampled_from(["null", row])) for _ in range(n)])
    if draw(st.booleans()):
        meta["routed_experts"] = '"AAAAAQ=="'
    if draw(st.booleans()):
        meta["some_future_field"] = '{"nested":[1,2]}'
    parts = {"text": '"hi"', "output_ids": _spaced(draw, output_ids),
             "meta_info": _spaced(draw, [f'"{k}":{v}' for k, v in meta.items() if v is not None], "{", "}")}
    if "a part" in faults:
        del parts[draw(st.sampled_from(sorted(parts)))]
    return _spaced(draw, [f'"{k}":{v}' for k, v in parts.items()], "{", "}").encode()


def _outcome(decode: Callable[[bytes, int], Any], body: bytes, vocab: int) -> tuple[Any, ...]:
    """What a decoder makes of a body: every field of the result (arrays by dtype and bytes), or the error."""
    try:
        r = decode(body, vocab)
    except UpstreamError as exc:
        return ("error", exc.rule, exc.message, exc.status)
    arrays = [(a.dtype.str, a.shape, a.tobytes()) for a in (r.output_ids, r.logprobs)]
    routed = None if r.routed_experts is None else bytes(r.routed_experts)
    return ("ok", *arrays, r.text, r.finish_reason, r.prompt_tokens, r.completion_tokens, r.cached_tokens,
            r.weight_version, r.e2e_latency, r.rid, routed, r.top_logprobs, r.weight_versions)


@pytest.mark.parametrize("fault", [None, *_FAULTS])
@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_fast_path_agrees_with_the_strict_decoder(fault, data):
    body = data.draw(engine_texts(fault))
    expected = _outcome(engine_output._decode_strictly, body, VOCAB)
    assert _outcome(decode_generate_response, body, VOCAB) == expected
    event(f"{expected[0]} {expected[1] if expected[0] == 'error' else ''}, by the {_path(body)} path")


def _path(body: bytes) -> str:
    try:
        return "fast" if engine_output._accept(engine_output._fast_decoder(VOCAB).decode(body), VOCAB) else "strict"
    except (msgspec.DecodeError, UpstreamError):
        return "strict"


@settings(max_examples=examples(100), deadline=None)
@given(body=payloads())
def test_fast_path_takes_sglangs_own_shape(body):
    """Every well-formed body in SGLang's `[logprob, id, null]` shape (as orjson writes it) passes the fast path."""
    for entry in body["meta_info"]["output_token_logprobs"]:
        entry[2:] = [None]
    payload = orjson.dumps(body)
    fast = engine_output._accept(engine_output._fast_decoder(VOCAB).decode(payload), VOCAB)
    assert fast is not None
    assert _outcome(lambda *_: fast, payload, VOCAB) == _outcome(engine_output._decode_strictly, payload, VOCAB)


def test_vocabularies_past_int32_take_the_strict_path():
    """The fast path writes ids straight into int32; a vocabulary int32 cannot index is left to the strict path."""
    body, vocab = dumps(engine_body([5, 2**31 + 1], [-0.5, -1.0])), 2**31 + 2
    assert _outcome(decode_generate_response, body, vocab) == _outcome(engine_output._decode_strictly, body, vocab)


_EDGES = [(lp, tid) for lp in ["-3.4028234663852886e38", "3.4028234663852886e38", "-3.402823466385289e38",
                               "3.402823466385289e38", "-0.0", "1e-46"]
          for tid in ["0", "-0", str(VOCAB - 1), str(VOCAB), "-1"]]


@pytest.mark.parametrize(("logprob", "token_id"), _EDGES)
def test_fast_path_agrees_at_the_constraints_edges(logprob, token_id):
    """The fast path's bounds (a logprob float32 can hold, an id inside the vocabulary) on and just past the edge."""
    body = (f'{{"text":"","output_ids":[{token_id}],"meta_info":{{"finish_reason":{{"type":"stop","matched":null}},'
            f'"prompt_tokens":3,"completion_tokens":1,"output_token_logprobs":[[{logprob},{token_id},null]]}}}}')
    expected = _outcome(engine_output._decode_strictly, body.encode(), VOCAB)
    assert _outcome(decode_generate_response, body.encode(), VOCAB) == expected


def test_fast_path_takes_output_ids_written_with_whitespace():
    """`output_ids` is compared with the entries' ids as compact bytes first; spelled otherwise, it is decoded and
    compared as ints, still on the fast path."""
    body = (b'{"text":"","output_ids":[ 5,\n-0 ],"meta_info":{"finish_reason":{"type":"stop","matched":null},'
            b'"prompt_tokens":3,"completion_tokens":2,"output_token_logprobs":[[-0.5,5,null],[-1.0,0,null]]}}')
    assert engine_output._accept(engine_output._fast_decoder(VOCAB).decode(body), VOCAB) is not None
    assert _outcome(decode_generate_response, body, VOCAB) == _outcome(engine_output._decode_strictly, body, VOCAB)
