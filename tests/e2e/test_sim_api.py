"""sglang-sim over real HTTP: response shapes, deterministic generation, scripted replies, prefix caching."""

from __future__ import annotations

import base64
import json
import math

import httpx
import numpy as np
import pytest

from harness.launchers import start_sim
from support.families import PLAIN_REPLY
from support.sim import assert_baseline, books, chat_ids, info
from trajectory import get_family

META_KEYS = {"id", "finish_reason", "prompt_tokens", "weight_version", "completion_tokens", "cached_tokens",
             "e2e_latency", "output_token_logprobs", "input_token_logprobs", "num_retractions"}


@pytest.fixture(scope="module", params=PLAIN_REPLY)
def sim(request, tokenizer_dirs, hf_tokenizers):
    family = request.param
    args = ("--routed-experts-layers", "4", "--routed-experts-top-k", "2", "--context-length", "4096",
            "--kv-capacity-tokens", "20000")
    with start_sim(tokenizer_dirs[family], family, *args) as proc, httpx.Client(base_url=proc.url, timeout=30) as c:
        yield family, c, hf_tokenizers[family]
        assert_baseline(c)


@pytest.fixture
def client(sim):
    _, client, _ = sim
    yield client
    assert_baseline(client)


def _prompt(tok, text: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return chat_ids(tok, msgs)


def test_generate_shape_and_logprobs(sim, client):
    family, _, tok = sim
    ids = _prompt(tok, "Tell me something.")
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": -1,
                                       "rid": "shape-1", "sampling_params": {"max_new_tokens": 256}})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert set(meta) >= META_KEYS
    assert meta["id"] == "shape-1" and meta["prompt_tokens"] == len(ids)
    out = body["output_ids"]
    entries = meta["output_token_logprobs"]
    assert len(out) == len(entries) == meta["completion_tokens"]
    assert len(out) > 1
    stop_id = tok.convert_tokens_to_ids("<|im_end|>" if family == "qwen3" else "<｜end▁of▁sentence｜>")
    assert meta["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out[-1] == stop_id
    for e, t in zip(entries, out, strict=True):
        assert e[1] == t and math.isfinite(e[0]) and e[0] <= 0 and e[2] is None
    assert body["text"] == tok.decode(out[:-1], skip_special_tokens=True)
    assert isinstance(meta["e2e_latency"], float)


def test_generation_is_deterministic_and_seeded(client, sim):
    _, _, tok = sim
    ids = _prompt(tok, "Same prompt twice.")

    def gen(**sp):
        return client.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()

    a, b = gen(), gen()
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    c = gen(sampling_seed=7)
    assert c["output_ids"] != a["output_ids"]
    assert gen(sampling_seed=7)["output_ids"] == c["output_ids"]
    cut = client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 4}}).json()
    whole = client.post("/generate", json={"input_ids": ids, "return_logprob": True}).json()
    assert cut["output_ids"] == whole["output_ids"][:4]  # a length-cut reply is a prefix of the full one
    assert cut["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"][:4]


def test_temperature_changes_logprobs_not_tokens(client, sim):
    _, _, tok = sim
    ids = _prompt(tok, "temperature")
    hot = client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                         "sampling_params": {"temperature": 1.0}}).json()
    greedy = client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                            "sampling_params": {"temperature": 0.0}}).json()
    assert hot["output_ids"] == greedy["output_ids"]
    assert all(e[0] == 0.0 for e in greedy["meta_info"]["output_token_logprobs"])
    assert any(e[0] < 0 for e in hot["meta_info"]["output_token_logprobs"])


def test_length_finish_and_text_input(client):
    r = client.post("/generate", json={"text": "hello there", "sampling_params": {"max_new_tokens": 3}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert len(r["output_ids"]) == 3 == r["meta_info"]["completion_tokens"]
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}}).json()
    assert r["output_ids"] == [] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_scripted_reply_tokens_and_stop_controls(client, sim):
    _, _, tok = sim
    ids = _prompt(tok, "go [[sim: reply alpha beta gamma delta]]")
    full = client.post("/generate", json={"input_ids": ids}).json()
    assert full["text"] == "alpha beta gamma delta"
    cut = client.post("/generate", json={"input_ids": ids, "sampling_params": {"stop": [" gamma"]}}).json()
    assert cut["text"] == "alpha beta" and cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": " gamma"}
    kept = client.post("/generate", json={"input_ids": ids, "sampling_params": {"stop": " gamma",
                                                                               "no_stop_trim": True}}).json()
    assert kept["text"].startswith("alpha beta gamma")
    beta = tok.encode(" beta", add_special_tokens=False)[0]
    by_id = client.post("/generate", json={"input_ids": ids, "sampling_params": {"stop_token_ids": [beta]}}).json()
    assert by_id["output_ids"][-1] == beta and by_id["meta_info"]["finish_reason"]["matched"] == beta
    assert by_id["text"] == "alpha"
    n = client.post("/generate", json={"input_ids": _prompt(tok, "[[sim: tokens 17]]")}).json()
    assert n["meta_info"]["completion_tokens"] == 18  # 17 reply tokens + the stop token
    long = client.post("/generate", json={"input_ids": ids, "sampling_params": {"ignore_eos": True,
                                                                                "max_new_tokens": 30}}).json()
    assert long["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    texts = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                                           "return_text_in_logprobs": True}).json()["meta_info"]
    assert "".join(e[2] for e in texts["output_token_logprobs"][:-1]) == "alpha beta gamma delta"
    assert all(len(row) == 2 and row[0][1] == e[1] for row, e in
               zip(texts["output_top_logprobs"], texts["output_token_logprobs"], strict=True))


def test_scripted_tool_calls_follow_family_format(client, sim):
    family, _, tok = sim
    system = ('[[sim: think]] [[sim: tool_call name=get_weather args={"city": "Paris", "days": [1, 2]}]] '
              '[[sim: tool_call name=get_time args={"tz": "UTC"}]]')
    ids = _prompt(tok, "weather?", system=system)
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 400,
                                                                             "skip_special_tokens": False}}).json()
    assert r["meta_info"]["finish_reason"]["type"] == "stop"
    text = r["text"]
    calls = _parse_calls(family, tok, text)
    assert calls == [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"tz": "UTC"})]
    assert "<think>" in text and "</think>" in text
    # A later message with its own directive wins over the system one.
    ids2 = chat_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": "x"},
                          {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "[[sim: reply plain answer]]"}])
    assert client.post("/generate", json={"input_ids": ids2}).json()["text"] == "plain answer"


def _parse_calls(family: str, tok, text: str) -> list[tuple[str, object]]:
    """Parse with the session server's own family parser: the sim's format must round-trip through it."""
    parsed = get_family(family, tok).parse_completion(text)
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_cached_tokens_on_shared_prefix(client, sim):
    _, _, tok = sim
    flush = client.post("/flush_cache")
    assert flush.status_code == 200 and flush.text.startswith("Cache flushed.")
    shared = "You are a careful assistant. " * 20
    a = _prompt(tok, "first question", system=shared)
    b = _prompt(tok, "second, different question", system=shared)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    r1 = client.post("/generate", json={"input_ids": a}).json()
    assert r1["meta_info"]["cached_tokens"] == 0
    r2 = client.post("/generate", json={"input_ids": b}).json()
    assert r2["meta_info"]["cached_tokens"] == common
    # a continuation of the first conversation reuses prompt and reply
    cont = a + r1["output_ids"] + tok.encode("more", add_special_tokens=False)
    r3 = client.post("/generate", json={"input_ids": cont}).json()
    assert r3["meta_info"]["cached_tokens"] == len(a) + len(r1["output_ids"]) - 1
    data = books(client)
    assert data["kv_cached_tokens"] == data["kv_used_tokens"] > 0


def test_errors_are_sglang_shaped(client):
    r = client.post("/generate", json={"input_ids": [1] * 5000})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("The input (5000 tokens) is longer than the model's context length "
                                            "(4096 tokens).")
    r = client.post("/generate", json={"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 5000}})
    assert r.status_code == 400 and "maximum context length of 4096" in r.json()["error"]["message"]
    assert client.post("/generate", content=b"{not json").status_code == 400
    assert client.post("/generate", json={"input_ids": [10**9]}).status_code == 400
    assert client.post("/generate", json={}).status_code == 400
    r = client.post("/generate", json={"input_ids": [1, 2], "session_params": {"id": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "Invalid request: session id nope does not exist")


def test_info_endpoints(client, sim):
    family, _, _ = sim
    for path in ("/health", "/health_generate"):
        r = client.get(path)
        assert r.status_code == 200 and r.content == b""
    for path in ("/model_info", "/get_model_info"):
        m = client.get(path).json()
        assert m["model_path"] == f"sim-{family}" and m["is_generation"] is True and "weight_version" in m
    s = info(client)
    for key in ("max_total_num_tokens", "kv_used_tokens", "kv_capacity_tokens", "kv_cached_tokens",
                "open_sessions", "running_requests", "waiting_requests", "max_req_input_len", "version",
                "internal_states"):
        assert key in s
    assert s["max_total_num_tokens"] == s["kv_capacity_tokens"] == 20000
    assert client.get("/get_server_info").json()["max_total_num_tokens"] == 20000
    assert client.get("/v1/models").json()["data"][0]["id"] == f"sim-{family}"
    assert client.post("/abort_request", json={"rid": "does-not-exist"}).status_code == 200


def test_routing_key_recorded_and_routed_experts(client, sim):
    _, _, tok = sim
    ids = _prompt(tok, "experts")
    before = info(client)["routing_keys"]
    r = client.post("/generate", json={"input_ids": ids, "return_routed_experts": True},
                    headers={"X-SMG-Routing-Key": "session-abc"})
    assert info(client)["routing_keys"] == before + 1
    assert info(client)["last_routing_key"] == "session-abc"
    # SGLang's shape (detokenizer_manager.py _b64_encode_per_request, batch_result_processor.py
    # _maybe_collect_routed_experts): base64 int32 [seqlen - 1 - routed_experts_start_len, layers, top_k].
    body = r.json()
    experts = np.frombuffer(base64.b64decode(body["meta_info"]["routed_experts"]), dtype=np.int32)
    seqlen = len(ids) + len(body["output_ids"])
    assert experts.size == (seqlen - 1) * 4 * 2 and experts.min() >= 0
    tail = client.post("/generate", json={"input_ids": ids, "return_routed_experts": True,
                                          "routed_experts_start_len": len(ids)}).json()
    rest = np.frombuffer(base64.b64decode(tail["meta_info"]["routed_experts"]), dtype=np.int32)
    assert rest.size == (len(tail["output_ids"]) - 1) * 8
    assert np.array_equal(rest, experts[len(ids) * 8:][: rest.size])  # the same routing for the same tokens
    bad = client.post("/generate", json={"input_ids": ids, "return_routed_experts": True,
                                         "routed_experts_start_len": len(ids) + 1})
    assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
    plain = client.post("/generate", json={"input_ids": ids}).json()
    assert "routed_experts" not in plain["meta_info"]


def test_sse_stream_is_cumulative(client, sim):
    _, _, tok = sim
    ids = _prompt(tok, "[[sim: tokens 20]]")
    whole = client.post("/generate", json={"input_ids": ids}).json()
    chunks = []
    with client.stream("POST", "/generate", json={"input_ids": ids, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    final = json.loads(chunks[-2])
    assert final["output_ids"] == whole["output_ids"] and final["text"] == whole["text"]
    assert final["meta_info"]["finish_reason"]["type"] == "stop"


def test_streaming_sessions_need_the_flag(client):
    r = client.post("/open_session", json={"capacity_of_str_len": 100, "streaming": True})
    assert r.status_code == 400 and "--enable-streaming-session" in r.json()["error"]["message"]
    sid = client.post("/open_session", json={"capacity_of_str_len": 100}).json()
    assert isinstance(sid, str)
    client.post("/close_session", json={"session_id": sid})


def _events(client: httpx.Client, body: dict) -> list[dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_events_rebuild_the_reply(client, sim, interval):
    """A request's stream_interval (SGLang's rule: the first token at once, then every `interval` tokens) gives that
    many cumulative events, each the prefix of the plain reply -- text with multi-byte characters included."""
    _, _, tok = sim
    script = "[[sim: think]] [[sim: reply Grüße, 東京 — ok ✓]] [[sim: tool_call name=f args={\"k\": \"é\"}]]"
    ids = _prompt(tok, script)
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"stream_interval": interval}}
    whole = client.post("/generate", json=body).json()
    events = _events(client, body)
    n = len(whole["output_ids"])
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == [*sorted({1, *range(1 + interval, n, interval)}), n]
    for event in events[:-1]:
        k = event["meta_info"]["completion_tokens"]
        assert event["output_ids"] == whole["output_ids"][:k]
        assert event["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"][:k]
        assert event["text"] == tok.decode(whole["output_ids"][:k], skip_special_tokens=True)
        assert event["meta_info"]["finish_reason"] is None
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]


def test_delta_events_one_per_token_sum_to_the_reply(tokenizer_dirs, hf_tokenizers):
    """--incremental-streaming-output with --stream-interval 1: one delta event per token (the last token with the
    final event), whose texts, ids and logprobs concatenate to the plain reply."""
    tok = hf_tokenizers["qwen3"]
    args = ("--incremental-streaming-output", "--stream-interval", "1")
    with start_sim(tokenizer_dirs["qwen3"], "qwen3", *args) as proc, httpx.Client(base_url=proc.url) as client:
        ids = _prompt(tok, "[[sim: think]] [[sim: reply Grüße, 東京 ✓]] [[sim: tokens 30]]")
        body = {"input_ids": ids, "return_logprob": True}
        whole = client.post("/generate", json=body).json()
        events = _events(client, body)
        assert len(events) == len(whole["output_ids"])
        assert "".join(e["text"] for e in events) == whole["text"]
        assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
        assert ([x for e in events for x in e["meta_info"]["output_token_logprobs"]]
                == whole["meta_info"]["output_token_logprobs"])
        assert all("\ufffd" not in e["text"] for e in events)
