"""Run by the SGLang venv's python (tests/sglang/test_tool_grammar_oracle.py): for each case read from stdin, the
sampling key and value SGLang 0.5.23's chat endpoint sends its grammar backend for a tool choice.

A case is {"parser", "reasoning_parser", "tools", "tool_choice", "parallel"}. Required and named choices go through
`FunctionCallParser.get_structure_constraint` as serving_chat calls it with a reasoning parser configured
(`thinking_mode=False`, then `strip_structural_tag_excludes` with the reasoning detector's think tokens), serialized as
`to_sampling_params` does. `auto` (which SGLang leaves unconstrained unless a tool is strict) goes straight to the
detector's model-native tag with the same arguments, the tag SGLang would send were it to cap the calls.
"""

import json
import sys

from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.function_call.utils import strip_structural_tag_excludes
from sglang.srt.parser.reasoning_parser import ReasoningParser
from sglang.utils import convert_json_schema_to_str


def constraint(case: dict) -> list:
    tools = [Tool(**t) for t in case["tools"]]
    choice = case["tool_choice"]
    choice = ToolChoice(**choice) if isinstance(choice, dict) else choice
    parser = FunctionCallParser(tools, case["parser"])
    if choice == "auto":
        value = parser.detector.get_structural_tag(tools=parser.structural_tag_tools(), tool_choice="auto",
                                                   thinking_mode=False, parallel_tool_calls=case["parallel"])
        key = "structural_tag"
        if value is None:  # no model-native tag: SGLang sends nothing for auto
            return [None, None]
    else:
        key, value = parser.get_structure_constraint(choice, parallel_tool_calls=case["parallel"], thinking_mode=False)
    if key != "structural_tag":
        return [key, convert_json_schema_to_str(value)]
    if case.get("reasoning_parser"):
        detector = ReasoningParser(model_type=case["reasoning_parser"], stream_reasoning=True).detector
        strip_structural_tag_excludes(value, (detector.think_start_token, detector.think_end_token))
    return [key, convert_json_schema_to_str(value.model_dump(by_alias=True))]


if __name__ == "__main__":
    print(json.dumps([constraint(case) for case in json.load(sys.stdin)]))
