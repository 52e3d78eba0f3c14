"""Run by the SGLang venv's python (tests/sglang/test_thinking_mode_oracle.py): for each case read from stdin, the
reasoning parser SGLang 0.5.23 suggests for a tokenizer's chat template and whether its chat server puts a request
with those `chat_template_kwargs` in thinking mode (the `require_reasoning` it sends).

A case is {"tokenizer": DIR, "kwargs": {...} | null}. The mode is `OpenAIServingChat._get_reasoning_from_request`
itself, on a server object holding what its constructor and the template manager would (the suggested parser, its
detector, the reasoning config detected from the template): the rest of the server is not needed to decide it.
"""

import json
import sys
import types

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.parser.reasoning_parser import ReasoningParser
from sglang.srt.parser.template_detection import (
    REASONING_PARSER_RULES,
    build_detection_context,
    detect_reasoning_pattern,
    match_rules,
)
from transformers import AutoTokenizer


def server(tokenizer_dir: str) -> OpenAIServingChat:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template = tokenizer.chat_template
    force, config = detect_reasoning_pattern(template)
    context = build_detection_context(template, tokenizer, config, force)
    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    chat.reasoning_parser = match_rules(context, REASONING_PARSER_RULES, "reasoning parser") if context else None
    chat.template_manager = types.SimpleNamespace(reasoning_config=config)
    chat._reasoning_detector = (ReasoningParser(model_type=chat.reasoning_parser, stream_reasoning=True).detector
                                if chat.reasoning_parser else None)
    return chat


if __name__ == "__main__":
    servers: dict[str, OpenAIServingChat] = {}
    answers = []
    for case in json.load(sys.stdin):
        chat = servers.setdefault(case["tokenizer"], server(case["tokenizer"]))
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                        chat_template_kwargs=case["kwargs"])
        answers.append([chat.reasoning_parser, chat._get_reasoning_from_request(request)])
    print(json.dumps(answers))
