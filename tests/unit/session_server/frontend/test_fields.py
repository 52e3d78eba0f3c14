"""Request fields -> SGLang sampling keys, prompt tools and template kwargs (the table of frontend/fields.py).

The sampling params the server builds are checked against SGLang 0.5.23's own request schema
(`sglang.api.v1.api_types.SamplingParams`, which rejects unknown keys and wrong types), loaded from the installed
package without importing the engine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.chat.protocol import parse_chat_request
from session_server.engine.wire import GenerateRequest, encode_generate
from session_server.frontend.chat_request import ChatRequest, turn_tools
from support.examples import examples
from trajectory import GenerateResult, LinearTrajectory
from trajectory.errors import RequestValidationError

STOP = (151645, 151643)
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}},
]
MESSAGES = [{"role": "user", "content": "hi"}]


def _sglang_schema() -> Any:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "api" / "v1" / "api_types.py"
    module_spec = importlib.util.spec_from_file_location("_sglang_api_types", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["_sglang_api_types"] = module
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sglang_api() -> Any:
    return _sglang_schema()


@pytest.fixture(scope="module")
def qwen3(families: dict[str, Any]) -> Any:
    return families["qwen3"]


def _parse(body: dict[str, Any], family: Any = None) -> tuple[ChatRequest, Any]:
    chat = parse_chat_request(json.dumps({"messages": MESSAGES, **body}).encode(), STOP, 151669)
    tools = turn_tools(chat, family) if family is not None else None
    return chat, tools


def _refused(body: dict[str, Any], field: str, family: Any = None) -> str:
    with pytest.raises(RequestValidationError) as info:
        _parse(body, family)
    assert field in info.value.message, info.value.message
    return info.value.message


def test_every_field_maps_to_a_key_sglang_accepts(sglang_api: Any, qwen3: Any) -> None:
    chat, tools = _parse({
        "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_p": 0.05, "logit_bias": {"15": -100, "16": 5},
        "seed": 2**63 - 1, "top_k": 20, "top_p": 0.9, "temperature": 0.7, "max_tokens": 64, "stop": ["\n\n"],
        "logprobs": True, "top_logprobs": 5,
    }, qwen3)
    sp = chat.sampling_params
    assert sp["presence_penalty"] == 0.5 and sp["frequency_penalty"] == -0.5 and sp["repetition_penalty"] == 1.1
    assert sp["min_p"] == 0.05 and sp["logit_bias"] == {"15": -100.0, "16": 5.0} and sp["sampling_seed"] == 2**63 - 1
    parsed = sglang_api.SamplingParams.from_json_value(sp)  # SGLang's own schema: unknown keys are refused
    assert parsed.structural_tag == sp["structural_tag"]
    body = msgspec.json.decode(encode_generate(GenerateRequest(
        input_ids=np.arange(3, dtype="int32"), sampling_params=sp, rid="r" * 32,
        top_logprobs=chat.options.top_logprobs)))
    assert body["top_logprobs_num"] == 5
    sglang_api.GenerateRequest.from_json_value(body)
    assert tools == TOOLS


def test_response_format_becomes_json_schema(sglang_api: Any, qwen3: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    chat, _ = _parse({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                     qwen3)
    assert json.loads(chat.sampling_params["json_schema"]) == schema
    sglang_api.SamplingParams.from_json_value(chat.sampling_params)
    chat, _ = _parse({"response_format": {"type": "json_object"}}, qwen3)
    assert chat.sampling_params["json_schema"] == '{"type": "object"}'
    assert not chat.options.parse_tool_calls  # a JSON answer is content, as in SGLang
    chat, _ = _parse({"response_format": {"type": "text"}}, qwen3)
    assert "json_schema" not in chat.sampling_params
    _refused({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format")
    _refused({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
             "response_format.json_schema.schema")
    _refused({"response_format": {"type": "yaml"}}, "response_format")
    _refused({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
             qwen3)


def test_tool_choice_shapes_prompt_tools_and_constraint(qwen3: Any) -> None:
    chat, tools = _parse({"tools": TOOLS, "tool_choice": "none"}, qwen3)
    assert tools is None and "structural_tag" not in chat.sampling_params and not chat.options.parse_tool_calls
    chat, tools = _parse({"tools": TOOLS, "tool_choice": "auto"}, qwen3)
    assert tools == TOOLS and "structural_tag" not in chat.sampling_params
    chat, tools = _parse({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, qwen3)
    assert tools == [TOOLS[1]]
    tag = json.loads(chat.sampling_params["structural_tag"])
    # SGLang's legacy structural tag for Qwen25Detector: begin/end from structure_info, schema only when strict.
    assert tag == {"type": "structural_tag", "triggers": ["<tool_call>"], "at_least_one": True, "structures": [
        {"begin": '<tool_call>\n{"name":"lookup", "arguments":', "schema": TOOLS[1]["function"]["parameters"],
         "end": "}\n</tool_call>"}]}
    chat, _ = _parse({"tools": TOOLS, "tool_choice": "required"}, qwen3)
    tag = json.loads(chat.sampling_params["structural_tag"])
    assert [s["schema"] for s in tag["structures"]] == [{}, TOOLS[1]["function"]["parameters"]]
    chat, _ = _parse({"tools": TOOLS, "parallel_tool_calls": False}, qwen3)
    fmt = json.loads(chat.sampling_params["structural_tag"])["format"]
    assert fmt["type"] == "triggered_tags" and fmt["stop_after_first"] and not fmt["at_least_one"]
    _refused({"tool_choice": "required"}, "tool_choice", qwen3)
    _refused({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", qwen3)
    _refused({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice")
    _refused({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls")


@pytest.mark.parametrize(("body", "field"), [
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": 10**40}, "max_tokens"),
    ({"seed": 2**63}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": True}, "min_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999999999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"200000": 1}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"regex": "a+"}, "regex"),
    ({"ebnf": "root ::= 'a'"}, "ebnf"),
    ({"n": 2}, "n"),
    ({"stop": ["x"] * 33}, "stop"),
])
def test_unhonourable_or_out_of_bounds_fields_are_400s_naming_the_field(body: dict[str, Any], field: str) -> None:
    _refused(body, field)


@settings(max_examples=examples(200), deadline=None)
@given(st.dictionaries(
    st.sampled_from(["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "temperature", "top_p",
                     "top_k", "max_tokens", "seed", "top_logprobs"]),
    st.one_of(st.integers(min_value=-(2**80), max_value=2**80), st.floats(allow_nan=True), st.booleans(),
              st.none(), st.text(max_size=3)),
))
def test_any_numeric_field_is_accepted_within_sglang_bounds_or_refused(body: dict[str, Any]) -> None:
    """Whatever numbers arrive, the outcome is a 400 or sampling params SGLang's SamplingParams.verify accepts."""
    body = {k: v for k, v in body.items() if not (isinstance(v, float) and v != v)}  # NaN is not JSON
    try:
        chat = parse_chat_request(json.dumps({"messages": MESSAGES, "logprobs": True, **body}).encode(), STOP, 1000)
    except RequestValidationError:
        return
    sp = chat.sampling_params
    assert -2 <= sp.get("presence_penalty", 0) <= 2 and -2 <= sp.get("frequency_penalty", 0) <= 2
    assert 0 < sp.get("repetition_penalty", 1) <= 2 and 0 <= sp.get("min_p", 0) <= 1
    assert 0 < sp.get("top_p", 1) <= 1 and 1 <= (sp["max_new_tokens"] or 1) < 2**31  # null: up to the context
    assert -(2**63) <= sp.get("sampling_seed", 0) < 2**63 and sp.get("top_k", 1) < 2**31
    # never overflows
    encode_generate(GenerateRequest(input_ids=np.arange(2, dtype="int32"), sampling_params=sp, rid="r" * 32))


def test_enable_thinking_changes_the_prompt_and_keeps_tito_prefixes(qwen3: Any) -> None:
    """Qwen3's template writes an empty think block after the generation prompt for enable_thinking=False; the
    kwargs reach the first render and every continuation, and stored tokens stay the prompt's prefix."""
    plain, off = LinearTrajectory(qwen3), LinearTrajectory(qwen3)
    kwargs = {"enable_thinking": False}
    p_plain, p_off = plain.prepare(MESSAGES), off.prepare(MESSAGES, None, kwargs)
    text_plain, text_off = qwen3.decode(p_plain.prompt_ids), qwen3.decode(p_off.prompt_ids)
    assert text_off == text_plain + "<think>\n\n</think>\n\n"
    for traj, plan in ((plain, p_plain), (off, p_off)):
        reply = [*qwen3.encode("Hello there."), qwen3.eos_token_id]
        result = GenerateResult(text="Hello there.", output_ids=np.asarray(reply, dtype=np.int32),
                                logprobs=np.full(len(reply), -0.5, dtype=np.float32),
                                finish_reason={"type": "stop", "matched": qwen3.eos_token_id},
                                prompt_tokens=len(plan.prompt_ids), completion_tokens=len(reply))
        traj.commit(plan, result, {"role": "assistant", "content": "Hello there."})
    nxt = [*MESSAGES, {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "more"}]
    n_plain, n_off = plain.prepare(nxt), off.prepare(nxt, None, kwargs)
    assert np.array_equal(n_off.prompt_ids[: off.num_tokens], off.token_ids)  # the TITO prefix invariant
    assert np.array_equal(n_plain.prompt_ids[: plain.num_tokens], plain.token_ids)
    tail_plain = qwen3.decode(n_plain.prompt_ids[n_plain.new_token_start:])
    tail_off = qwen3.decode(n_off.prompt_ids[n_off.new_token_start:])
    assert tail_off == tail_plain + "<think>\n\n</think>\n\n"
    assert tail_plain.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
    {"tools": TOOLS, "parallel_tool_calls": False},
    {"tools": TOOLS, "tool_choice": "none", "presence_penalty": -2, "frequency_penalty": 2, "min_p": 1},
    {"response_format": {"type": "json_object"}, "repetition_penalty": 2, "logit_bias": {"0": -100, "151668": 100}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}, "seed": -(2**63)},
    {"stop": ["\n\n", "END"], "top_k": -1, "top_p": 1e-9, "temperature": 0, "max_tokens": 2**31 - 1},
])
def test_sglangs_own_sampling_params_accept_what_the_fields_become(body: dict[str, Any], qwen3: Any) -> None:
    """SGLang 0.5.23's SamplingParams(**sp).normalize(tokenizer).verify(vocab): the scheduler-side checks (bounds,
    one grammar at most, logit_bias ids in the vocabulary) -- a TypeError or ValueError there is SGLang's 400."""
    from support.sglang_real import import_sglang_schema

    sampling = import_sglang_schema("sglang.srt.sampling.sampling_params")
    chat, _ = _parse(body, qwen3)
    params = sampling.SamplingParams(**chat.sampling_params)
    params.normalize(qwen3.tokenizer)
    params.verify(qwen3.vocab_size)


def test_schema_verdicts_are_remembered_for_valid_and_invalid_schemas(monkeypatch) -> None:
    """Every request of an agent repeats its tool schemas: each distinct schema is checked against the metaschema
    once, and a bad one stays a 400 every time."""
    import jsonschema

    from session_server.frontend import fields as openai_fields

    calls: list[object] = []
    real = jsonschema.Draft202012Validator.check_schema

    def counting(schema: object, *args: object, **kwargs: object) -> None:
        calls.append(schema)
        real(schema, *args, **kwargs)

    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema", counting)
    openai_fields._schema_problem.cache_clear()
    good = {"type": "object", "properties": {"q": {"type": "string", "minLength": 1}}, "x-nonce": "remembered"}
    bad = {"type": "object", "properties": {"q": {"type": 5}}, "x-nonce": "remembered"}
    for _ in range(3):
        openai_fields._check_schema(dict(reversed(list(good.items()))), "tools[0].function.parameters")
        with pytest.raises(RequestValidationError, match=r"tools\[1\].function.parameters' is not a valid JSON"):
            openai_fields._check_schema(bad, "tools[1].function.parameters")
    assert len(calls) == 2  # one check per distinct schema (key order does not make a schema distinct)
    # A schema too large to remember is checked every time: new large schemas cannot grow the cache.
    large = {"type": "object", "description": "d" * openai_fields.CACHED_SCHEMA_BYTES}
    for _ in range(2):
        openai_fields._check_schema(large, "tools[2].function.parameters")
    assert len(calls) == 4 and openai_fields._schema_problem.cache_info().currsize == 2


def test_more_tools_than_openai_allows_is_a_400_before_any_schema_is_checked(qwen3: Any, monkeypatch) -> None:
    from session_server.frontend import fields as openai_fields

    def never(*args: object) -> None:
        raise AssertionError("no schema may be checked for a refused request")

    monkeypatch.setattr(openai_fields, "_metaschema_problem", never)
    monkeypatch.setattr(openai_fields, "_schema_problem", never)
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object", "x-i": i}}}
             for i in range(openai_fields.MAX_TOOLS + 1)]
    message = _refused({"tools": tools}, "'tools' may have at most 128 entries", qwen3)
    assert "got 129" in message


def test_a_tools_list_is_checked_once_and_its_verdict_bounded(qwen3: Any, monkeypatch) -> None:
    """An agent resends the same tools every turn: the list is validated once (then one encode and one lookup), a list
    that differs in any byte is validated again, a bad list is refused every time with the same 400, and a list too
    large to remember is validated every time (no client can grow the cache past its bound)."""
    from session_server.frontend import fields as openai_fields

    checked: list[str] = []
    real = openai_fields._check_schema

    def counting(schema: Any, field: str) -> None:
        checked.append(field)
        real(schema, field)

    monkeypatch.setattr(openai_fields, "_check_schema", counting)
    openai_fields._tools_verdict.cache_clear()
    for _ in range(3):
        assert _parse({"tools": TOOLS, "tool_choice": "auto"}, qwen3)[1] == TOOLS
    assert len(checked) == len(TOOLS)
    reordered = [TOOLS[0], {"function": TOOLS[1]["function"], "type": "function"}]
    _parse({"tools": reordered}, qwen3)
    assert len(checked) == 2 * len(TOOLS)
    bad = [*TOOLS, {"type": "function", "function": {"name": "bad", "parameters": {"type": 5}}}]
    for _ in range(2):
        assert "tools[2].function.parameters' is not a valid JSON Schema" in _refused({"tools": bad}, "tools[2]", qwen3)
    # the choice is still checked against each request's own list
    _refused({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", qwen3)
    large = [{"type": "function", "function": {"name": "big", "description": "d" * openai_fields.CACHED_TOOL_LIST_BYTES,
                                               "parameters": {"type": "object"}}}]
    before = len(checked)
    for _ in range(2):
        _parse({"tools": large}, qwen3)
    assert len(checked) == before + 2
    assert openai_fields._tools_verdict.cache_info().currsize == 3
    assert openai_fields._tools_verdict.cache_info().maxsize == openai_fields.TOOL_LIST_VERDICTS


def test_the_tools_list_is_held_to_the_body_rules_once_per_distinct_list(qwen3: Any, monkeypatch) -> None:
    """The chat body decode leaves the tools list to its verdict: a list that nests too deep or holds an integer
    beyond 64 bits is still the body's 400, word for word, and a list seen before is not walked again."""
    from session_server.frontend import fields as openai_fields
    from session_server.http import body as http_body

    openai_fields._tools_verdict.cache_clear()
    deep: Any = "leaf"
    for _ in range(http_body.MAX_DEPTH):
        deep = [deep]
    too_deep = [{"type": "function", "function": {"name": "d", "parameters": {"type": "object", "x-d": deep}}}]
    with pytest.raises(RequestValidationError) as info:
        http_body.decode_object(json.dumps({"tools": too_deep}).encode())
    for _ in range(2):
        assert _refused({"tools": too_deep}, "nests deeper", qwen3) == info.value.message
    big = [{"type": "function", "function": {"name": "b", "parameters": {"type": "object", "x-n": 2**70}}}]
    assert "at 'tools'[0]['function']['parameters']['x-n']" in _refused({"tools": big}, "beyond 64 bits", qwen3)

    walked: list[object] = []
    real = openai_fields.check_json_value
    monkeypatch.setattr(openai_fields, "check_json_value", lambda value: walked.append(value) or real(value))
    for _ in range(3):
        _parse({"tools": TOOLS}, qwen3)
    assert len(walked) == 1


def test_a_request_with_every_field_null_reads_as_one_without_them() -> None:
    """The table reads a field only when it is present and not null: every row's rule is skipped for a null."""
    from session_server.frontend import fields

    nulls = {row.name: None for row in fields.CHAT_FIELDS}
    assert fields.read_fields(nulls, STOP, 100) == fields.read_fields({}, STOP, 100)
    assert fields.read_fields(nulls, STOP, 100).options is fields.read_fields({}, STOP).options


def test_every_row_names_one_field_and_goes_to_a_known_place() -> None:
    """One row per field; each goes to the chat request, its options or a sampling key (or nowhere: refused or
    only checked), and max_completion_tokens and max_tokens, which fill one place, are read in that order."""
    from session_server.frontend import fields

    names = [row.name for row in fields.CHAT_FIELDS]
    assert len(names) == len(set(names))
    option_names = set(fields.RequestOptions.__dataclass_fields__)
    for row in fields.CHAT_FIELDS:
        for to in row.to:
            place, key = to.split(".")
            assert place in ("request", "options", "sampling") and (place != "options" or key in option_names)
    shared = [row.name for row in fields.CHAT_FIELDS if row.to == ("sampling.max_new_tokens",)]
    assert shared == ["max_completion_tokens", "max_tokens"]
    both = fields.read_fields({"max_completion_tokens": 7, "max_tokens": "ignored when the newer field is set"}, STOP)
    assert both.sampling["max_new_tokens"] == 7


def test_every_apis_reply_limit_is_one_rule_naming_the_apis_own_field() -> None:
    from session_server.frontend.fields import MAX_INT32
    from session_server.messages.protocol import parse_messages
    from session_server.responses.protocol import parse_responses

    range_ = f"must be an integer in [1, {MAX_INT32}]"
    for bad in (0, MAX_INT32 + 1, 2.5, True, "8"):
        with pytest.raises(RequestValidationError) as chat:
            parse_chat_request(json.dumps({"messages": MESSAGES, "max_completion_tokens": bad}).encode(), STOP)
        assert chat.value.message == f"'max_tokens' / 'max_completion_tokens' {range_}"
        with pytest.raises(RequestValidationError) as responses:
            parse_responses({"input": "hi", "max_output_tokens": bad}, None)
        assert responses.value.message == f"'max_output_tokens' {range_}"
        with pytest.raises(RequestValidationError) as messages:
            parse_messages({"messages": MESSAGES, "max_tokens": bad}, None)
        assert messages.value.message == f"'max_tokens' {range_}"
    with pytest.raises(RequestValidationError, match=f"'max_tokens' {range_}".replace("[", r"\[")):
        parse_messages({"messages": MESSAGES}, None)  # Messages requires it, except to count tokens
    assert parse_messages({"messages": MESSAGES}, None, count_only=True).chat.get("max_tokens") is None
    assert parse_responses({"input": "hi", "max_output_tokens": MAX_INT32}, None).chat["max_tokens"] == MAX_INT32


def test_a_key_table_reads_each_row_as_declared() -> None:
    """A request object's keys by its table: a row is all a new key needs. Mapped keys pass, ignored ones are
    reported (by the table's prefix) when their `when` holds, refused ones are a 400 naming `where.key`, in the
    table's order after any key without a row."""
    from session_server.frontend.fields import Key, Keys, ignored, refused

    table = Keys((Key("kept"), ignored("hint"), ignored("flag", when=bool), refused("no", "is refused"),
                  refused("odd", "must be even", when=lambda v: v % 2 == 1)), unknown="is unheard of", report="obj.")
    assert table.read({"kept": 1, "hint": "x", "flag": False, "no": None, "odd": 2}) == ["obj.hint"]
    assert table.read({"flag": True, "hint": None}, "parent") == ["obj.flag"]
    for body, message in [({"no": 0}, "'no' is refused"), ({"odd": 3}, "'odd' must be even"),
                          ({"odd": 3, "no": 1}, "'no' is refused"), ({"no": 1, "what": 1}, "'what' is unheard of")]:
        with pytest.raises(RequestValidationError) as exc:
            table.read(body)
        assert exc.value.message == message
    with pytest.raises(RequestValidationError) as exc:
        table.read({"odd": 1}, "parent[2]")
    assert exc.value.message == "'parent[2].odd' must be even"


def _key_rows(table: Any, action: str) -> list[str]:
    return [row.name for row in table.rows if row.action == action]


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_every_ignored_key_of_an_api_is_reported_and_every_refused_one_named(api: str) -> None:
    """Each ignored row of the Responses and Messages tables is accepted and reported in `ignored` (not when null),
    each refused row is a 400 that names the key; no key is in two rows."""
    from session_server.frontend import fields
    from session_server.messages.protocol import parse_messages
    from session_server.responses.protocol import parse_responses

    if api == "responses":
        table, base = fields.RESPONSES_KEYS, {"input": "hi"}

        def parse(body: dict[str, Any]) -> Any:
            return parse_responses(body, "enable_thinking")
    else:
        table, base = fields.MESSAGES_KEYS, {"model": "m", "max_tokens": 8, "messages": MESSAGES}

        def parse(body: dict[str, Any]) -> Any:
            return parse_messages(body, "enable_thinking")
    names = [row.name for row in table.rows]
    assert len(names) == len(set(names)) and set(base) <= set(_key_rows(table, "mapped"))
    for name in _key_rows(table, "ignored"):
        assert parse({**base, name: "set"}).ignored == [name]
        assert parse({**base, name: None}).ignored == []
    for name in _key_rows(table, "refused"):
        with pytest.raises(RequestValidationError, match=f"^'{name}' "):
            parse({**base, name: "set"})


def test_the_nested_key_tables_report_and_refuse_by_their_own_names() -> None:
    from session_server.frontend import fields
    from session_server.messages.protocol import parse_messages
    from session_server.responses.protocol import parse_responses

    assert parse_responses({"input": "hi", "text": {"verbosity": None}}, None).ignored == ["text.verbosity"]
    with pytest.raises(RequestValidationError, match=r"^'text\.tone' is not supported"):
        parse_responses({"input": "hi", "text": {"tone": "dry"}}, None)
    base = {"model": "m", "max_tokens": 8, "messages": MESSAGES}
    for name in _key_rows(fields.MESSAGES_OUTPUT_CONFIG_KEYS, "ignored"):
        assert parse_messages({**base, "output_config": {name: "x"}}, None).ignored == [f"output_config.{name}"]
    tool = {"name": "f", "input_schema": {"type": "object"}}
    for name in _key_rows(fields.MESSAGES_TOOL_KEYS, "ignored"):
        assert parse_messages({**base, "tools": [{**tool, name: {}}]}, None).ignored == [f"tools.{name}"]
    with pytest.raises(RequestValidationError, match=r"^'tools\[0\]\.color' is not supported"):
        parse_messages({**base, "tools": [{**tool, "color": "red"}]}, None)
