"""sglang-sim reads a message's `[[sim: ...]]` directives whatever JSON the message holds around them.

A scripted agent's tool results are often JSON (`{"temperature": 25}`), and a template may write the whole message
as a JSON string (Llama 3.1 writes tool results with `tojson`). The reader must find the directive in both, and a
quote inside the tool result's JSON (the closing quote of a key) must never be taken for the start of the string
that holds it: that misreading gave no call, and a scripted agent whose tools answer in JSON stopped calling tools.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_sim import directives
from sglang_sim.family import EngineFamily
from sglang_sim.generation import find_script
from support.examples import examples
from support.families import FAMILIES
from support.on_first_use import OnFirstUse
from support.tito import identifiers

_TEXT = st.text(max_size=12).filter(lambda s: "[[" not in s)  # a directive only where the test puts one
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False), _TEXT)
JSON_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)), max_leaves=12)
ARGS = st.dictionaries(_TEXT, JSON_VALUES, max_size=3)
# [A-Za-z_][A-Za-z0-9_.\-]{0,15}, drawn without from_regex (4x the cost an example)
NAMES = identifiers(string.ascii_letters + "_", string.ascii_letters + string.digits + "_.-", 15)
SEPARATORS = st.sampled_from(["", " ", "\n", "\n\n", " , "])


def _message(before: Any, after: Any, call: str, sep: str, placement: str) -> str:
    """A tool result that holds JSON before the directive, after it or on both sides."""
    parts = {"before": [json.dumps(before), call], "after": [call, json.dumps(after)],
             "around": [json.dumps(before), call, json.dumps(after)]}[placement]
    return sep.join(parts)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a shared machine
@given(before=JSON_VALUES, after=JSON_VALUES, name=NAMES, args=ARGS, sep=SEPARATORS,
       placement=st.sampled_from(["before", "after", "around"]),
       quoting=st.sampled_from(["plain", "tojson", "tojson-ascii"]))
def test_a_tool_call_is_read_whatever_json_surrounds_it(before: Any, after: Any, name: str, args: dict[str, Any],
                                                         sep: str, placement: str, quoting: str) -> None:
    message = _message(before, after, directives.tool_call(name, **args), sep, placement)
    text = {"plain": message, "tojson": json.dumps(message, ensure_ascii=False),
            "tojson-ascii": json.dumps(message)}[quoting]
    script = directives.read(text)
    assert script.tool_calls == ((name, json.dumps(args, ensure_ascii=False)),)


@pytest.mark.parametrize("text", [
    '{"temperature": 25} [[sim: tool_call name=get_weather args={"city": "B"}]]',  # the example
    json.dumps('{"temperature": 25} [[sim: tool_call name=get_weather args={"city": "B"}]]'),
    '["a", {"b": "c"}]\n[[sim: tool_call name=get_weather args={"city": "B"}]]\n{"d": 1}',
])
def test_the_reported_tool_results(text: str) -> None:
    assert directives.read(text).tool_calls == (("get_weather", '{"city": "B"}'),)


def test_a_directive_inside_a_json_value_is_read_unescaped() -> None:
    """A tool that returns its directive inside its JSON (`{"note": "... [[sim: ...]]"}`) scripts the reply too."""
    text = json.dumps({"note": 'done [[sim: tool_call name=f args={"x": "y"}]]', "n": 1})
    assert directives.read(text).tool_calls == (("f", '{"x": "y"}'),)


def test_other_directives_beside_json() -> None:
    script = directives.read('{"k": "v"} [[sim: think]] [[sim: tokens 7]] {"z": [1]}')
    assert (script.think, script.tokens, script.tool_calls) == (True, 7, ())
    assert directives.read(json.dumps('{"k": "v"} [[sim: reply It is "42".]]')).reply == 'It is "42".'


@pytest.fixture(scope="module")
def engine_families(hf_tokenizers: dict[str, Any], families: dict[str, Any]) -> Mapping[str, EngineFamily]:
    """Each family's engine side, made when a test first reads it: a worker binds only the families its tests read."""
    return OnFirstUse(FAMILIES, lambda name: EngineFamily.create(name, hf_tokenizers[name], family=families[name]))


_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("family_name", FAMILIES)
@settings(max_examples=examples(15), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(result=JSON_VALUES, placement=st.sampled_from(["before", "after", "around"]))
def test_every_family_reads_the_call_in_a_json_tool_result(engine_families: Mapping[str, EngineFamily],
                                                           family_name: str, result: Any, placement: str) -> None:
    """Through each family's real template and tokenizer, as the engine sees a rendered tool loop."""
    family = engine_families[family_name]
    call = directives.tool_call("get_weather", city="B")
    content = _message(result, result, call, " ", placement)
    messages = [
        {"role": "user", "content": "What is the weather in A?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "A"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": content},
    ]
    text = family.tokenizer.apply_chat_template(messages, tools=_TOOLS, tokenize=False, add_generation_prompt=True)
    prompt = np.array(family.tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
    script = find_script(family, prompt)
    assert script is not None and script.tool_calls == (("get_weather", '{"city": "B"}'),)
