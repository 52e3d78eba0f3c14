"""Turns through the session server against the real engine (released SGLang 0.5.23 on CPU, a tiny random Qwen3).

What the suite proves against the sim, here against SGLang itself: TITO over several turns (every prompt the engine
received is the stored prefix plus the appended messages' tokens; the engine's output ids and logprobs are stored
exactly; the radix cache's `cached_tokens` grows turn by turn), plain and streamed chats (SGLang streams cumulative
chunks that may carry several tokens; the streamed reply equals the plain one under greedy decoding), a reply without
`max_tokens` (sent as `max_new_tokens: null`: SGLang runs to the end of the context, not to its default 128),
constrained decoding (tool_choice required, response_format json_schema) reaching SGLang's xgrammar backend, and a
forced tool call in thinking mode, which the engine (run with `--reasoning-parser qwen3`) holds back until `</think>`:
the model thinks first, as behind SGLang's own chat server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import assert_sample_is_what_the_engine_saw, chat_url, new_session, sse_events
from support.sglang_engine import Served, ServeFactory
from trajectory import samples_from_json

GREEDY = {"temperature": 0, "max_tokens": 8}
# Thinking off: the prompt closes the think block, the grammar applies from the first token (the random model would
# otherwise think without end before a constrained answer).
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense") as s:
        yield s


def chat(served: Served, sid: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    r = httpx.post(chat_url(served.server, sid), json={"messages": messages, **GREEDY, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def delete(served: Served, sid: str) -> None:
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204


def test_multi_turn_tito_stores_what_the_engine_saw(served: Served) -> None:
    sid = new_session(served.server)
    served.proxy.clear()
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(3):
        history.append({"role": "user", "content": f"Question {turn}: what is {turn} + {turn}?"})
        reply = chat(served, sid, history)
        assert reply["choices"][0]["finish_reason"] in ("length", "stop")
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    calls = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert len(calls) == 3 and all(c["status"] == 200 for c in calls)
    sample = samples_from_json(httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
    spans = assert_sample_is_what_the_engine_saw(sample, calls)
    info = httpx.get(f"{served.server}/sessions/{sid}", timeout=30).json()
    assert [(r["prompt_len"], r["completion_len"]) for r in info["records"]] == [(a, b - a) for a, b in spans]
    # The radix cache holds each turn: the next prompt's cached prefix covers at least the previous prompt.
    cached = [c["response"]["meta_info"]["cached_tokens"] for c in calls]
    for (start, _), prev_cached, now_cached in zip(spans[:-1], cached[:-1], cached[1:], strict=True):
        assert now_cached > prev_cached and now_cached >= start, (cached, spans)
    for call in calls:  # what the server asked for: greedy, our rid, logprobs of the output only
        req = call["request"]
        assert req["return_logprob"] is True and req["logprob_start_len"] == -1
        assert req["sampling_params"]["temperature"] == 0 and req["sampling_params"]["max_new_tokens"] == 8
        assert req["rid"] == call["response"]["meta_info"]["id"]
    delete(served, sid)


def test_streamed_chat_equals_the_plain_one(served: Served) -> None:
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
    sid = new_session(served.server)
    plain = chat(served, sid, messages, max_tokens=24)
    delete(served, sid)
    sid = new_session(served.server)
    served.proxy.clear()
    with httpx.stream("POST", chat_url(served.server, sid), timeout=120, json={
        "messages": messages, **GREEDY, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True},
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    events = sse_events(body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == plain["choices"][0]["message"]["content"]
    finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finish == [plain["choices"][0]["finish_reason"]]
    usage = dict(events[-1]["usage"])
    assert usage.pop("prompt_tokens_details")["cached_tokens"] > 0  # the plain chat left the prompt in the cache
    assert usage == {k: v for k, v in plain["usage"].items() if k != "prompt_tokens_details"}
    (call,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert call["request"]["stream"] is True and call["stream_chunks"] >= 2
    sample = samples_from_json(httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
    assert_sample_is_what_the_engine_saw(sample, [call])  # the last cumulative chunk, stored exactly
    delete(served, sid)


def test_no_max_tokens_runs_to_the_end_of_the_context(served: Served) -> None:
    """Without `max_tokens` the server sends `max_new_tokens: null`; SGLang then stops at the context length (2048 in
    the tiny checkpoint), not at the 128 it uses when the key is left out. A long prompt keeps the reply short. SGLang
    caps a request at `max_req_len - input_len - 1` with `max_req_len = context_len - 1` (scheduler.py): 2046 tokens
    in all."""
    sid = new_session(served.server)
    served.proxy.clear()
    long_text = " ".join(f"word{i}" for i in range(480))  # ~1840 tokens: room for ~200 more
    r = httpx.post(chat_url(served.server, sid), timeout=300, json={
        "messages": [{"role": "user", "content": long_text}], "temperature": 0})
    assert r.status_code == 200, r.text
    (call,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert call["request"]["sampling_params"]["max_new_tokens"] is None
    meta = call["response"]["meta_info"]
    assert meta["prompt_tokens"] + meta["completion_tokens"] == 2048 - 2, meta["finish_reason"]
    assert meta["completion_tokens"] > 128
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == meta["completion_tokens"]
    delete(served, sid)


OP_TOOL = {"type": "function", "function": {
    "name": "pick", "description": "Pick an operation.", "strict": True,
    "parameters": {"type": "object", "properties": {"op": {"type": "string", "enum": ["add", "sub"]}},
                   "required": ["op"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def whitespace_ids(served: Served) -> list[int]:
    """The vocabulary's whitespace-only tokens. A random model's greedy choice is often one of them, and the JSON
    inside SGLang's tool-call structural tag admits whitespace without end (unlike a json_schema constraint, no
    engine flag limits it there), so the tool-call test biases them away, as an agent may with `logit_bias`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.checkpoint)
    return [i for i in range(len(tok)) if (text := tok.decode([i])) and not text.strip()]


def test_tool_choice_required_is_decoded_under_the_grammar(served: Served, whitespace_ids: list[int]) -> None:
    sid = new_session(served.server)
    served.proxy.clear()
    # One call (`parallel_tool_calls: false`): the structural tag then stops after the first call, where the model
    # must end; with parallel calls allowed, free text may follow a call, and a random model never stops.
    reply = chat(served, sid, [{"role": "user", "content": "Pick one."}], tools=[OP_TOOL], tool_choice="required",
                 parallel_tool_calls=False, max_tokens=256, logit_bias={str(i): -100 for i in whitespace_ids},
                 **NO_THINKING)
    (call,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    sampling = call["request"]["sampling_params"]
    assert "structural_tag" in sampling and len(sampling["logit_bias"]) == len(whitespace_ids)
    assert "require_reasoning" not in call["request"]
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", (call["request"]["sampling_params"], call["response"]["text"])
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "pick"
    assert json.loads(tool_call["function"]["arguments"])["op"] in ("add", "sub")
    delete(served, sid)


def test_response_format_json_schema_is_decoded_under_the_grammar(served: Served) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    sid = new_session(served.server)
    served.proxy.clear()
    reply = chat(served, sid, [{"role": "user", "content": "Yes or no?"}], max_tokens=64, **NO_THINKING,
                 response_format={"type": "json_schema", "json_schema": {"name": "yn", "schema": schema}})
    (call,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
    assert json.loads(call["request"]["sampling_params"]["json_schema"]) == schema
    assert "require_reasoning" not in call["request"]
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")
    delete(served, sid)


def test_a_model_native_tool_grammar_is_decoded_by_sglangs_backend(served: Served, whitespace_ids: list[int]) -> None:
    """The model-native structural tag the session server sends for Qwen3.5/3.6's XML calls (tool_grammar.py, held to
    SGLang's own by test_tool_grammar_oracle.py) is taken by SGLang's xgrammar backend, and what the engine decodes
    under it parses as Qwen3.5's calls. The engine serves a Qwen3 vocabulary, which spells the XML markup as well; the
    prompt goes to /generate as ids, as the session server sends it; whitespace biased away as above (the XML style
    admits it without end too)."""
    from transformers import AutoTokenizer

    from session_server.frontend.tool_grammar import native_structural_tag
    from trajectory.families.xml_tool_calls import parse_calls

    tok = AutoTokenizer.from_pretrained(served.checkpoint)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Pick one."}], tools=[OP_TOOL], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
    tag = native_structural_tag("qwen_3_coder", [OP_TOOL], "pick", required=True, parallel=False)
    body = {"input_ids": tok.encode(prompt, add_special_tokens=False), "sampling_params": {
        "temperature": 0, "max_new_tokens": 256, "structural_tag": json.dumps(tag),
        "logit_bias": {str(i): -100 for i in whitespace_ids}}}
    r = httpx.post(f"{served.engine}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert text.startswith("<tool_call>\n<function=pick>\n"), text
    content, calls = parse_calls(text, [OP_TOOL])
    assert content == "" and [c.name for c in calls] == ["pick"], text
    assert json.loads(calls[0].arguments).get("op") in ("add", "sub"), (text, calls)
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop", r.json()["meta_info"]


def test_a_forced_call_in_thinking_mode_lets_the_model_think_first(served: Served) -> None:
    """Thinking on (Qwen3's default), the forced call's /generate says `require_reasoning` and the engine holds its
    grammar back until `</think>`: the first tokens are those the same prompt yields unconstrained (greedy; the random
    model does not close its think block within them, checked). Thinking off, the grammar applies at once: the reply
    starts with the call's tag."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.checkpoint)
    ask = [{"role": "user", "content": "Pick one."}]
    outputs: dict[tuple[bool, str], dict[str, Any]] = {}
    for thinking in (True, False):
        for choice in ("required", "auto"):
            sid = new_session(served.server)
            served.proxy.clear()
            chat(served, sid, ask, tools=[OP_TOOL], tool_choice=choice, parallel_tool_calls=True,
                 chat_template_kwargs={"enable_thinking": thinking})
            (call,) = [c for c in served.proxy.settled() if c["path"] == "/generate"]
            outputs[thinking, choice] = call
            delete(served, sid)
    for thinking in (True, False):
        forced, free = outputs[thinking, "required"], outputs[thinking, "auto"]
        assert forced["request"]["input_ids"] == free["request"]["input_ids"]  # the same prompt, tools and all
        assert "structural_tag" in forced["request"]["sampling_params"]
        assert "structural_tag" not in free["request"]["sampling_params"] and "require_reasoning" not in free["request"]
        assert forced["request"].get("require_reasoning") is (True if thinking else None)
    think_end = tok.convert_tokens_to_ids("</think>")
    free_ids = outputs[True, "auto"]["response"]["output_ids"]
    assert len(free_ids) == GREEDY["max_tokens"] and think_end not in free_ids  # still thinking after these tokens
    assert outputs[True, "required"]["response"]["output_ids"] == free_ids
    # The grammar spells the tag's text (its tokens are the grammar's choice: xgrammar matches bytes, not ids).
    assert tok.decode(outputs[False, "required"]["response"]["output_ids"]).startswith("<tool_call>")
    assert not tok.decode(outputs[False, "auto"]["response"]["output_ids"]).startswith("<tool_call>")
