"""Chat Completions' plain reply: a chat completion built from the turn's output (the validated engine reply and the
family's parse of it, turns/output.py) with the facts every API's reply reads (frontend/reply_facts.py); stream.py
builds its chunks from the same pieces (finish reason, fingerprint, usage).

Pure, so it runs on the CPU pool. The reply is encoded once, from the already parsed completion, and never carries
the heavy replay payloads (routed experts stay in the trajectory's records).
"""

from __future__ import annotations

from typing import Any

import msgspec

from session_server.chat.logprobs import openai_logprobs
from session_server.chat.policy_spans import policy_token_spans
from session_server.engine.adapters import AdapterRef
from session_server.frontend.fields import RequestOptions
from session_server.frontend.reply_facts import ReplyFacts, reply_facts
from session_server.frontend.token_ids import TurnTokens
from session_server.turns.output import TurnOutput
from trajectory import GenerateResult, ModelFamily

_encoder = msgspec.json.Encoder()


# Chat's names for how a turn ended (frontend/reply_facts.py); a matched stop string is a plain "stop" here.
_FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


def finish_reason(facts: ReplyFacts) -> str:
    return _FINISH[facts.ending]


def system_fingerprint(family: ModelFamily, result: GenerateResult) -> str:
    """What produced the reply: the model family and the engine's weight version (changes with every update)."""
    return f"{family.name}-{result.weight_version or 'default'}"


def usage(facts: ReplyFacts) -> dict[str, Any]:
    """OpenAI's usage; the reasoning's tokens in `completion_tokens_details` when there are some (SGLang's
    UsageProcessor sets that field only then)."""
    body: dict[str, Any] = {
        "prompt_tokens": facts.prompt_tokens,
        "completion_tokens": facts.completion_tokens,
        "total_tokens": facts.total_tokens,
        "prompt_tokens_details": {"cached_tokens": facts.cached_tokens},
    }
    if facts.reasoning_tokens:
        body["completion_tokens_details"] = {"reasoning_tokens": facts.reasoning_tokens}
    return body


def chat_completion(
    out: TurnOutput, family: ModelFamily, rid: str, model: str, created: int, options: RequestOptions,
    tokens: TurnTokens | None = None, adapter: AdapterRef | None = None,
) -> bytes:
    """The client reply of a plain turn, encoded once. It never carries the heavy replay payloads (routed experts
    stay in the trajectory's records). `tokens`: the turn's ids, as vLLM writes them for `return_token_ids`
    (`prompt_token_ids` beside the choices, `token_ids` in the choice). `adapter`: the LoRA adapter revision of the
    turn, named on the choice as ART reads it (policy_spans.py)."""
    result, message = out.result, out.message
    facts = reply_facts(family, result, message)
    logprobs = (openai_logprobs(family.tokenizer, result.output_ids, result.logprobs, result.top_logprobs,
                                options.top_logprobs, options.tokens_as_token_ids) if options.logprobs else None)
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason(facts),
                              "logprobs": logprobs,
                              **policy_token_spans(adapter, rid, facts.prompt_tokens, facts.completion_tokens)}
    body: dict[str, Any] = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint(family, result),
        "choices": [choice],
        "usage": usage(facts),
    }
    if tokens is not None:
        body["prompt_token_ids"] = tokens.prompt_token_ids
        choice["token_ids"] = tokens.token_ids
    return _encoder.encode(body)
