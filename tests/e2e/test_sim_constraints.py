"""sglang-sim honours SGLang's sampling keys like the real engine: unknown keys are a 400, constraints shape the reply.

Over real HTTP on both families: a `json_schema` reply is an instance of the schema, a structural tag with
`at_least_one` forces a call in the family's own tool-call format, `stop_after_first` keeps one call, penalties and
logit_bias have their deterministic effect, and the streamed events (cumulative or incremental) add up to the reply.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from harness.launchers import start_sim
from support.families import PLAIN_REPLY
from support.sim import assert_baseline, chat_ids
from trajectory import get_family

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer",
                                                                                        "minimum": 3, "maximum": 4}},
     "required": ["name", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}, "minItems": 4, "maxItems": 4},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}, "x": {"const": 7}},
     "$defs": {"p": {"type": "string"}}, "required": ["x"]},
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"],
     "$defs": {"p": {"type": "object", "properties": {"q": {"type": "string", "minLength": 12}}, "required": ["q"]}}},
]


@pytest.fixture(scope="module", params=PLAIN_REPLY)
def sim(request: pytest.FixtureRequest, tokenizer_dirs: dict[str, Any], hf_tokenizers: dict[str, Any]) -> Iterator[
        tuple[str, httpx.Client, Any]]:
    family = request.param
    with start_sim(tokenizer_dirs[family], family, "--incremental-streaming-output") as proc, \
            httpx.Client(base_url=proc.url, timeout=30) as client:
        yield family, client, hf_tokenizers[family]
        assert_baseline(client)


def _generate(client: httpx.Client, ids: list[int], sp: dict[str, Any], **kw: Any) -> httpx.Response:
    return client.post("/generate", json={"input_ids": ids, "sampling_params": {"skip_special_tokens": False, **sp},
                                          "return_logprob": True, **kw})


def test_unknown_and_out_of_range_sampling_keys_are_400(sim: Any) -> None:
    _, client, tok = sim
    ids = chat_ids(tok, [{"role": "user", "content": "hi"}])
    for sp, words in (({"temprature": 0.5}, "unknown field `temprature`"), ({"min_p": 2}, "min_p"),
                      ({"presence_penalty": -3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                      ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"json_schema": "{", "top_p": 0.5}, "json"),
                      ({"json_schema": "{}", "structural_tag": "{}"}, "Only one of"), ({"regex": "a+"}, "regex"),
                      ({"json_schema": json.dumps({"type": "string", "pattern": "^a"})}, "pattern")):
        r = _generate(client, ids, sp)
        error = r.json()["error"]
        # A broken contract (an unknown key) is SGLang's bare text; a refused value its {"message": ...} object.
        text = error if "unknown field" in words else error["message"]
        assert r.status_code == 400 and isinstance(text, str) and words in text, (sp, r.text)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_reply_is_an_instance(sim: Any, schema: dict[str, Any]) -> None:
    _, client, tok = sim
    ids = chat_ids(tok, [{"role": "user", "content": "JSON please. [[sim: think]]"}])
    r = _generate(client, ids, {"json_schema": json.dumps(schema), "max_new_tokens": 512})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    answer = text.split("</think>")[-1].strip()
    jsonschema.validate(json.loads(answer), schema)


def test_structural_tags_force_and_limit_tool_calls(sim: Any) -> None:
    family_name, client, tok = sim
    family = get_family(family_name, tok)
    prefix, suffix, end, trigger = family.tool_call_structure
    structures = [{"begin": prefix + name + suffix, "schema": schema, "end": end} for name, schema in (
        ("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}), ("lookup", {}))]
    forced = {"type": "structural_tag", "structures": structures, "triggers": [trigger], "at_least_one": True}
    ids = chat_ids(tok, [{"role": "user", "content": "Just talk."}])
    reply = family.parse_completion(_generate(client, ids, {"structural_tag": json.dumps(forced)}).json()["text"])
    assert [c.name for c in reply.tool_calls] == ["add"] and json.loads(reply.tool_calls[0].arguments)["a"] is not None
    two = ('[[sim: tool_call name=add args={"a": 1}]] [[sim: tool_call name=lookup args={"key": "k"}]]'
           ' [[sim: tool_call name=other args={}]]')
    ids = chat_ids(tok, [{"role": "user", "content": two}])
    reply = family.parse_completion(_generate(client, ids, {"structural_tag": json.dumps(forced)}).json()["text"])
    assert [c.name for c in reply.tool_calls] == ["add", "lookup"]  # a tool outside the tag is not emitted
    one = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [trigger], "at_least_one": False,
                                                "stop_after_first": True, "tags": [
                                                    {"begin": s["begin"], "end": s["end"],
                                                     "content": {"type": "json_schema", "json_schema": s["schema"]}}
                                                    for s in structures]}}
    reply = family.parse_completion(_generate(client, ids, {"structural_tag": json.dumps(one)}).json()["text"])
    assert [c.name for c in reply.tool_calls] == ["add"]


def test_penalties_and_logit_bias(sim: Any) -> None:
    _, client, tok = sim
    ids = chat_ids(tok, [{"role": "user", "content": "Talk. [[sim: tokens 60]]"}])

    def reply(**sp: Any) -> dict[str, Any]:
        r = _generate(client, ids, {"sampling_seed": 5, **sp})
        assert r.status_code == 200, r.text
        return r.json()

    def words(**sp: Any) -> list[str]:
        return reply(**sp)["text"].split()

    base = reply()
    assert len(set(words(presence_penalty=1.0))) == len(words(presence_penalty=1.0))
    assert len(set(words(repetition_penalty=0.5))) == 1
    banned = base["output_ids"][:3]
    biased = reply(logit_bias={str(t): -100 for t in banned})
    assert not set(banned) & set(biased["output_ids"])
    favoured = tok.encode(" lattice", add_special_tokens=False)[0]
    assert reply(logit_bias={str(favoured): 5})["output_ids"][0] == favoured
    again = reply()
    assert again["output_ids"] == base["output_ids"] and again["text"] == base["text"]  # deterministic


def test_incremental_stream_events_add_up_to_the_reply(sim: Any) -> None:
    _, client, tok = sim
    ids = chat_ids(tok, [{"role": "user", "content": "Talk. [[sim: tokens 30]] [[sim: think]]"}])
    whole = _generate(client, ids, {"sampling_seed": 1}).json()
    text, out, lps = "", [], []
    with client.stream("POST", "/generate", json={"input_ids": ids, "stream": True, "return_logprob": True,
                                                  "sampling_params": {"sampling_seed": 1, "skip_special_tokens": False
                                                                      }}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += event["text"]
                out += event["output_ids"]
                lps += event["meta_info"]["output_token_logprobs"]
                assert event["meta_info"]["completion_tokens"] == len(out)
    assert out == whole["output_ids"] and lps == whole["meta_info"]["output_token_logprobs"]
    assert text.startswith(whole["text"].split("</think>")[0])
