"""DeltaTracker: deltas streamed from any prefix sequence of a reply always assemble to the final parse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.turns.deltas import DeltaTracker
from trajectory import get_family

_text = st.lists(st.sampled_from([*"ab \n<>/{}\"'tol_c", "é", "\n\n", "</think>", "<tool_call>", "</tool_call>"]),
                 max_size=20).map("".join)
_calls = st.lists(st.tuples(st.sampled_from(["add", "lookup"]),
                            st.dictionaries(st.sampled_from(["a", "key"]), st.integers(-5, 5), max_size=2)),
                  max_size=3)


@pytest.fixture(scope="module", params=["qwen3", "deepseek"])
def family(request: pytest.FixtureRequest, hf_tokenizers: dict[str, Any]) -> Any:
    return get_family(request.param, hf_tokenizers[request.param])


def _assemble(family: Any, text: str, cuts: list[int], parse_tool_calls: bool = True) -> dict[str, Any]:
    tracker = DeltaTracker(family, "call_x", parse_tool_calls)
    out: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    deltas = [tracker.update(text[:cut]) for cut in sorted(cuts)]
    final = family.parse_reply(text, parse_tool_calls).to_message("call_x")
    deltas.append(tracker.finish(final))
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            out[key] += (delta or {}).get(key, "")
        out["tool_calls"] += (delta or {}).get("tool_calls", [])
    assert [c["index"] for c in out["tool_calls"]] == list(range(len(out["tool_calls"])))
    assert out["content"] == final["content"]
    assert out["reasoning_content"] == (final.get("reasoning_content") or "")
    assert [(c["id"], c["function"]) for c in out["tool_calls"]] == [
        (c["id"], c["function"]) for c in final.get("tool_calls", [])]
    return out


@settings(max_examples=300, deadline=None)
@given(content=_text, reasoning=st.one_of(st.none(), _text), calls=_calls, data=st.data())
def test_any_chunking_assembles_to_the_final_message(family: Any, content: str, reasoning: str | None,
                                                      calls: list[tuple[str, dict[str, int]]], data: Any) -> None:
    text = family.format_completion(content, reasoning, [(n, json.dumps(a)) for n, a in calls])
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    _assemble(family, text, cuts)
    _assemble(family, text, cuts, parse_tool_calls=False)
    _assemble(family, text[: data.draw(st.integers(0, len(text)))], cuts)  # cut by length anywhere


def test_text_streams_early_and_calls_arrive_whole(hf_tokenizers: dict[str, Any]) -> None:
    qwen = get_family("qwen3", hf_tokenizers["qwen3"])
    text = qwen.format_completion("Let me check.", "thinking hard", [("add", '{"a": 1}')])
    tracker = DeltaTracker(qwen, "call_x")
    assert tracker.update("<thi") is None
    assert tracker.update("<think>\nthinking") == {"reasoning_content": "thinking"}
    assert tracker.update("<think>\nthinking hard\n</thi") == {"reasoning_content": " hard"}
    head = text[: text.index("<tool_call>") + 12]
    assert tracker.update(head) == {"content": "Let me check."}  # the open call is held back
    assert tracker.update(text)["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert tracker.finish(qwen.parse_reply(text).to_message("call_x")) is None
