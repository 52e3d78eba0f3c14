"""Each injected fault breaks the wire the way it says (checked with the session server's strict decoder), and
none of them disturbs the engine's KV books."""

from __future__ import annotations

import time

import httpx
import pytest

from harness.launchers import start_sim
from support.sim import assert_baseline, books, chat_ids, info
from trajectory.engine_output import decode_generate_response
from trajectory.errors import UpstreamError

RULES = {
    "malformed_json": {"json"},
    "nan_logprob": {"json", "logprob_value"},
    "str_logprob": {"logprob_value"},
    "bool_token": {"output_ids", "token_id_type"},
    "str_token": {"output_ids", "token_id_type"},
    "oob_token": {"token_range"},
    "length_mismatch": {"length_mismatch"},
}


@pytest.fixture(scope="module")
def sim(tokenizer_dirs, hf_tokenizers):
    with start_sim(tokenizer_dirs["deepseek"], "deepseek") as proc:
        yield proc.url, hf_tokenizers["deepseek"]


@pytest.fixture
def client(sim):
    with httpx.Client(base_url=sim[0], timeout=30) as c:
        yield c
        c.post("/sim/faults", json={})
        assert_baseline(c)


def _body(tok) -> dict:
    ids = chat_ids(tok, [{"role": "user", "content": "fault [[sim: tokens 12]]"}])
    return {"input_ids": ids, "return_logprob": True, "logprob_start_len": -1}


def test_clean_response_passes_the_strict_decoder(client, sim):
    _, tok = sim
    r = client.post("/generate", json=_body(tok))
    result = decode_generate_response(r.content, len(tok))
    assert result.completion_tokens == 13 and result.finish_reason["type"] == "stop"


@pytest.mark.parametrize("fault", sorted(RULES))
def test_body_faults_break_one_rule(client, sim, fault):
    _, tok = sim
    r = client.post("/generate", json=_body(tok), headers={"X-Sim-Fault": fault})
    assert r.status_code == 200
    with pytest.raises(UpstreamError) as err:
        decode_generate_response(r.content, len(tok))
    assert err.value.rule in RULES[fault], (fault, err.value.rule, str(err.value))
    if fault == "nan_logprob":
        assert b"NaN" in r.content
    assert books(client)["private"] == 0


def test_http_500_drop_and_delay(client, sim):
    _, tok = sim
    r = client.post("/generate", json=_body(tok), headers={"X-Sim-Fault": "http_500"})
    assert r.status_code == 500 and "error" in r.json()
    with pytest.raises(httpx.RemoteProtocolError):
        client.post("/generate", json=_body(tok), headers={"X-Sim-Fault": "drop_connection"})
    started = time.monotonic()
    r = client.post("/generate", json=_body(tok), headers={"X-Sim-Fault": "delay=0.3"})
    assert r.status_code == 200 and time.monotonic() - started >= 0.3
    decode_generate_response(r.content, len(tok))
    assert client.post("/generate", json=_body(tok), headers={"X-Sim-Fault": "bogus"}).status_code == 400


def test_stream_faults(client, sim):
    _, tok = sim
    with pytest.raises(httpx.RemoteProtocolError), client.stream(
            "POST", "/generate", json={**_body(tok), "stream": True},
            headers={"X-Sim-Fault": "drop_connection"}) as r:
        for _ in r.iter_lines():
            pass
    with client.stream("POST", "/generate", json={**_body(tok), "stream": True},
                       headers={"X-Sim-Fault": "oob_token"}) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    with pytest.raises(UpstreamError):
        decode_generate_response(data[-2].encode(), len(tok))


def test_random_faults_via_admin_endpoint(client, sim):
    _, tok = sim
    assert client.post("/sim/faults", json={"nope": 0.5}).status_code == 400
    assert client.post("/sim/faults", json={"http_500": 0.7, "oob_token": 0.7}).status_code == 400
    state = client.post("/sim/faults", json={"http_500": 1.0}).json()
    assert state["probabilities"] == {"http_500": 1.0}
    assert all(client.post("/generate", json=_body(tok)).status_code == 500 for _ in range(3))
    client.post("/sim/faults", json={"http_500": 0.3, "length_mismatch": 0.3})
    codes = []
    for _ in range(40):
        r = client.post("/generate", json=_body(tok))
        if r.status_code == 500:
            codes.append("500")
            continue
        try:
            decode_generate_response(r.content, len(tok))
            codes.append("ok")
        except UpstreamError:
            codes.append("bad")
    assert {"500", "ok", "bad"} <= set(codes)
    injected = client.get("/sim/faults").json()["injected"]
    assert injected["http_500"] >= 3
    client.post("/sim/faults", json={})
    assert client.post("/generate", json=_body(tok)).status_code == 200
    assert info(client)["running_requests"] == 0
