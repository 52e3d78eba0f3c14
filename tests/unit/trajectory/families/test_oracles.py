"""Each family against oracles we did not write: the model's own renderer, and SGLang 0.5.23's own parsers.

- Template: PrimeIntellect's `renderers` (PyPI) mirrors each model's published chat template token for token (its
  `Qwen35Renderer`/`Qwen36Renderer` for Qwen3.5/3.6, whose tokenizer ships no template): our rendered ids, multi-turn
  with tools and reasoning, equal its ids; and the ids TITO appends after a generated turn equal its
  `bridge_to_next_turn` (its own incremental rule).
- Parsers: SGLang's tool-call detector and reasoning detector for the family (imported through
  support/sglang_real.py) on hypothesis-generated replies (nested JSON, unicode, marker look-alikes, several calls;
  for Qwen3.5/3.6 also output cut anywhere): our parse equals SGLang's, for every registered family. The one
  normalisation: SGLang's strings keep the separators the template writes around the reasoning block (`\\n` inside
  it, `\\n\\n` after it) and before the first call (`\\n\\n`), which our parse drops because the template writes
  them back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.on_first_use import OnFirstUse
from support.sglang_real import import_sglang_schema
from support.tito import _ALPHABET, ARGUMENT_NAME, CALL_NAME
from support.tito import call_item as _call
from trajectory import LinearTrajectory, ModelFamily
from trajectory.families.xml_tool_calls import _json_type

renderers = pytest.importorskip("renderers")
from renderers.configs import Qwen35RendererConfig, Qwen36RendererConfig  # noqa: E402

RENDERER_CONFIGS = {"qwen3.5": Qwen35RendererConfig, "qwen3.6": Qwen36RendererConfig}
SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def oracle_renderers(hf_tokenizers: dict[str, Any]) -> Mapping[str, Any]:
    """Each renderer made when a test first reads it: a worker loads only the tokenizers its tests read."""
    return OnFirstUse(tuple(RENDERER_CONFIGS),
                      lambda name: renderers.create_renderer(hf_tokenizers[name], RENDERER_CONFIGS[name]()))


TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}, "n": {"type": "integer"},
                                         "exact": {"type": "boolean"}, "opts": {"type": "object"}},
        "required": ["key"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
]


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief. Ünïcödé ok."},
    {"role": "user", "content": "Look up naïve keys 東京"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "need both",
     "tool_calls": [_call(0, "lookup", {"key": "東京", "n": 2, "exact": True, "opts": {"deep": [1, None]}}),
                    _call(1, "add", {"a": 1.5, "b": -2})]},
    {"role": "tool", "tool_call_id": "c0", "content": "found 3"},
    {"role": "tool", "tool_call_id": "c1", "content": "-0.5"},
    {"role": "assistant", "content": "Both done.", "reasoning_content": "sum them"},
    {"role": "user", "content": "  and again?  "},
    {"role": "assistant", "content": "", "tool_calls": [_call(2, "lookup", {"key": "x"})]},
    {"role": "tool", "tool_call_id": "c2", "content": "y"},
]


@pytest.mark.parametrize("name", RENDERER_CONFIGS)
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_rendered_ids_equal_the_models_renderer(families, oracle_renderers, name, tools):
    family, oracle = families[name], oracle_renderers[name]
    for end in range(2, len(CONVERSATION) + 1):
        messages = CONVERSATION[:end]
        for generation in (True, False):
            ours = family.encode(family.render(messages, tools, add_generation_prompt=generation))
            assert ours == oracle.render_ids(messages, tools=tools, add_generation_prompt=generation), (end, generation)


@pytest.mark.parametrize("name", RENDERER_CONFIGS)
def test_tito_ids_equal_the_renderers_bridge(families, oracle_renderers, name):
    """A tool loop played through LinearTrajectory: every appended prompt equals the renderer's bridged ids from
    the same stored prompt + completion."""
    family, oracle = families[name], oracle_renderers[name]
    traj = LinearTrajectory(family)
    from support.tito import Reply, generate

    history: list[dict[str, Any]] = [CONVERSATION[0], CONVERSATION[1]]
    replies = [Reply("Let me see.", "plan it", (("lookup", '{"key": "a", "n": 1}'),)),
               Reply("", None, (("add", '{"a": 1, "b": 2}'), ("lookup", '{"key": "b"}'))),
               Reply("Done: 3.", "all there")]
    appended_after = [
        [{"role": "tool", "tool_call_id": "call_r0_0", "content": "1"}],
        [{"role": "tool", "tool_call_id": "call_r1_0", "content": "3"},
         {"role": "tool", "tool_call_id": "call_r1_1", "content": "b!"}, {"role": "user", "content": "sum?"}],
    ]
    previous = None
    for k, reply in enumerate(replies):
        plan = traj.prepare(history, TOOLS)
        if previous is not None:
            bridged = oracle.bridge_to_next_turn(*previous, appended_after[k - 1], tools=TOOLS)
            if any(m["role"] == "user" for m in appended_after[k - 1]):
                # renderers does not bridge past a new user query (its full render drops the earlier reasoning,
                # so it re-renders instead); TITO keeps the tokens the model saw. Nothing to compare.
                assert bridged is None
            else:
                assert bridged is not None and plan.prompt_ids.tolist() == bridged.token_ids, k
        result, message = generate(family, plan, reply, rid=f"r{k}")
        traj.commit(plan, result, message)
        previous = (plan.prompt_ids.tolist(), result.output_ids.tolist())
        history = [*history, message, *(appended_after[k] if k < len(appended_after) else [])]


# -- SGLang's own parsers ------------------------------------------------------------------------------------------
_qwen3_coder = import_sglang_schema("sglang.srt.function_call.qwen3_coder_detector")
_reasoning = import_sglang_schema("sglang.srt.parser.reasoning_parser")
_protocol = import_sglang_schema("sglang.srt.entrypoints.openai.protocol")

_WORD = st.text(_ALPHABET, min_size=1, max_size=10)
_LOOKALIKE = st.sampled_from(["<tool_call", "tool_call>", "<function", "function=x", "<parameter", "</parameter",
                              "</think", "think>", "<|im_end", "{\"name\": \"f\"}", "```json", "<>", "</>"])
_PROSE = st.lists(_WORD | _LOOKALIKE | st.sampled_from([" ", "\n", "\n\n"]), max_size=8).map("".join)
_SCALAR = (st.integers(-10**9, 10**9) | st.floats(allow_nan=False, allow_infinity=False) | st.booleans()
           | st.text(_ALPHABET, max_size=12).filter(lambda s: s.lower() != "null"))
_JSON = st.recursive(st.none() | _SCALAR, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_WORD, inner, max_size=3), max_leaves=8)
_ARGS = st.dictionaries(ARGUMENT_NAME,
                        _SCALAR | st.lists(_JSON, max_size=3) | st.dictionaries(_WORD, _JSON, max_size=3),
                        max_size=4)
_CALLS = st.lists(st.tuples(CALL_NAME, _ARGS), max_size=3)


def _tools_for(calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One tool per name, each parameter typed as its (first) value is."""
    schemas: dict[str, dict[str, Any]] = {}
    for name, arguments in calls:
        properties = schemas.setdefault(name, {})
        for key, value in arguments.items():
            properties.setdefault(key, {"type": _json_type(value)})
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}}
            for n, p in schemas.items()]


def _sglang_qwen35(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, str, list[tuple[str, str]]]:
    """SGLang's chat path for a Qwen3.5 reply (serving_chat: reasoning parser `qwen3` forced open by the template's
    `<think>\\n`, then the `qwen3_coder` tool-call detector on the rest)."""
    reasoning = _reasoning.Qwen3Detector(stream_reasoning=False, force_reasoning=True).detect_and_parse(text)
    rest = reasoning.normal_text or ""
    sg_tools = [_protocol.Tool(**tool) for tool in tools]
    parsed = _qwen3_coder.Qwen3CoderDetector().detect_and_parse(rest, sg_tools)
    calls = [(call.name, call.parameters) for call in parsed.calls]
    content = parsed.normal_text if _qwen3_coder.Qwen3CoderDetector().has_tool_call(rest) else rest
    # the template's separators (see the module docstring)
    thought = reasoning.reasoning_text
    if thought is not None and "</think>" in text:
        thought = thought.removesuffix("\n")
        content = "" if "\n\n".startswith(content) else content.removeprefix("\n\n")  # cut inside it, too
    if "<tool_call>" in rest and content.strip():
        content = content.removesuffix("\n\n")
    return thought, content, calls


@pytest.mark.parametrize("name", RENDERER_CONFIGS)
@SETTINGS
@given(content=_PROSE, reasoning=st.none() | _PROSE, calls=_CALLS, cut=st.none() | st.integers(0, 400))
@example(content="", reasoning="000000000000```json<>", calls=[], cut=31)  # cut between the two newlines after
def test_parse_equals_sglangs_qwen3_coder_and_reasoning_parsers(families, name, content, reasoning, calls, cut):
    family = families[name]
    tools = _tools_for(calls)
    text = family.format_completion(content.strip(), reasoning if reasoning is not None else "",
                                    [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls])
    engine_text = text.removeprefix(family.reply_opening)[:cut]
    ours = family.parse_reply(family.reply_opening + engine_text, True, tools)
    thought, sg_content, sg_calls = _sglang_qwen35(engine_text, tools)
    assert (ours.reasoning_content, ours.content) == (thought or "", sg_content)
    assert [(c.name, c.arguments) for c in ours.tool_calls] == sg_calls


# qwen3 and the DeepSeek-style family: SGLang's `qwen25` and `deepseekv3` detectors with the `qwen3` / `deepseek-v3`
# reasoning parsers (not forced: these templates leave the reasoning block to the model).
_qwen25 = import_sglang_schema("sglang.srt.function_call.qwen25_detector")
_deepseekv3 = import_sglang_schema("sglang.srt.function_call.deepseekv3_detector")
_SGLANG_PARSERS = {
    "qwen3": (_qwen25.Qwen25Detector, _reasoning.Qwen3Detector, "\n", "\n\n"),
    "deepseek": (_deepseekv3.DeepSeekV3Detector, _reasoning._DeepSeekV3Detector, "", ""),
}


@pytest.mark.parametrize("name", _SGLANG_PARSERS)
@SETTINGS
@given(content=_PROSE, reasoning=st.none() | _PROSE, calls=_CALLS)
def test_parse_equals_sglangs_json_detectors(families, name, content, reasoning, calls):
    """Replies as the model writes them (what format_completion writes). SGLang strips the content before a call
    (`normal_text = text[:idx].strip()`) where we keep what the model wrote, so content is compared stripped when
    the reply has calls. Known divergences, outside this domain and left as they are: a reply cut inside a call
    (we keep the unclosed call as content, SGLang drops everything from the opener), text after the calls and a
    malformed call between good ones (we keep them in the content, SGLang drops them), calls to tools the request
    did not declare (SGLang drops them unless SGLANG_FORWARD_UNKNOWN_TOOLS)."""
    family = families[name]
    tool_detector, reasoning_detector, inner, after = _SGLANG_PARSERS[name]
    content = content.strip()
    reasoning = reasoning.strip() if reasoning is not None else None
    tools = _tools_for(calls)
    text = family.format_completion(content, reasoning, [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls])
    ours = family.parse_reply(text, True, tools)
    thought = reasoning_detector(stream_reasoning=False).detect_and_parse(text)
    rest = thought.normal_text or ""
    parsed = tool_detector().detect_and_parse(rest, [_protocol.Tool(**tool) for tool in tools])
    sg_reasoning = thought.reasoning_text
    if sg_reasoning is not None and reasoning is not None:
        sg_reasoning = sg_reasoning.removeprefix(inner).removesuffix(inner)  # the template's separators
    sg_content = parsed.normal_text if calls else rest.removeprefix(after) if reasoning is not None else rest
    assert (ours.reasoning_content or None, ours.content.strip() if calls else ours.content) == (
        sg_reasoning or None, sg_content)
    assert [(c.name, c.arguments) for c in ours.tool_calls] == [(c.name, c.parameters) for c in parsed.calls]


# DeepSeek V4: renderers' DeepSeekV4Renderer (DeepSeek's own encoder mirrored; chat and thinking mode), and SGLang's
# `deepseekv4` tool-call detector with the `deepseek-v4` reasoning parser (forced open in thinking mode, as SGLang
# does for `thinking: true`).
from renderers.configs import DeepSeekV4RendererConfig  # noqa: E402

_deepseekv4 = import_sglang_schema("sglang.srt.function_call.deepseekv4_detector")


@pytest.fixture(scope="module")
def deepseek_v4(families: dict[str, ModelFamily]) -> ModelFamily:
    return families["deepseek-v4"]


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_deepseek_v4_ids_equal_the_models_encoder(deepseek_v4, hf_tokenizers, thinking, tools):
    oracle = renderers.create_renderer(hf_tokenizers["deepseek-v4"], DeepSeekV4RendererConfig(enable_thinking=thinking))
    for end in range(2, len(CONVERSATION) + 1):
        messages = CONVERSATION[:end]
        for generation in (True, False):
            ours = deepseek_v4.encode(deepseek_v4.render(messages, tools, generation, {"thinking": thinking}))
            assert ours == oracle.render_ids(messages, tools=tools, add_generation_prompt=generation), (end, generation)


@SETTINGS
@given(content=_PROSE, reasoning=st.none() | _PROSE, calls=_CALLS, thinking=st.booleans(),
       cut=st.none() | st.integers(0, 400))
def test_deepseek_v4_parse_equals_sglangs(deepseek_v4, content, reasoning, calls, thinking, cut):
    family = deepseek_v4
    tools = _tools_for(calls)
    opening = family.reply_opening if thinking else ""
    text = family.format_completion(content.strip(), (reasoning or "") if thinking else None,
                                    [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls])
    engine_text = text.removeprefix(opening)[:cut]
    ours = family.parse_reply(opening + engine_text, True, tools)
    thought = _reasoning.DeepSeekV4Detector(stream_reasoning=False, force_reasoning=thinking).detect_and_parse(
        engine_text)
    rest = thought.normal_text or ""
    parsed = _deepseekv4.DeepSeekV4Detector().detect_and_parse(rest, [_protocol.Tool(**tool) for tool in tools])
    content_sg = parsed.normal_text if _deepseekv4.DeepSeekV4Detector().has_tool_call(rest) else rest
    assert (ours.reasoning_content or None, ours.content) == (thought.reasoning_text or None, content_sg)
    assert [(c.name, c.arguments) for c in ours.tool_calls] == [(c.name, c.parameters) for c in parsed.calls]
