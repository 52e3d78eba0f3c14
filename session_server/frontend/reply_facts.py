"""What every API's reply says about one generated turn, computed once: why it ended, the token counts, and the
server-sent-event framing.

Chat Completions, Responses and Anthropic Messages name the same facts differently (`finish_reason: tool_calls`,
`status: completed` with function_call items, `stop_reason: tool_use`; `prompt_tokens` vs `input_tokens`), so each
front end renders them from this one reading of the engine result (the way SGLang's `usage_processor.py` serves all
its APIs). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from trajectory import GenerateResult, ModelFamily

_encoder = msgspec.json.Encoder()

Ending = Literal["stop", "length", "tool_calls", "stop_sequence"]


@dataclass(frozen=True, slots=True)
class ReplyFacts:
    ending: Ending
    stop_sequence: str | None  # the `stop` string the engine matched, for `ending == "stop_sequence"`
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def reasoning_token_count(family: ModelFamily, output_ids: np.ndarray, reasoning: str | None) -> int:
    """How many sampled tokens the reasoning block took: up to and including its closing marker when that is one
    token (Qwen3's and DeepSeek's `</think>`), else all of them for an unterminated block, or where the family says
    (harmony's analysis messages); 0 without reasoning."""
    if not reasoning:
        return 0
    own = family.reasoning_end(output_ids)
    if own is not None:
        return own
    if family.reasoning_markers is None:
        return 0
    close = family.encode(family.reasoning_markers[1])
    if len(close) == 1:
        hits = np.flatnonzero(output_ids == close[0])
        if len(hits):
            return int(hits[0]) + 1
        return len(output_ids)
    return min(len(output_ids), len(family.encode(reasoning)))


def reply_facts(family: ModelFamily, result: GenerateResult, message: dict[str, Any],
                stop: list[str] | None = None) -> ReplyFacts:
    """The facts of a validated engine result and the assistant message parsed from it; `stop` is the request's
    stop strings (a matched one is reported as such, as Anthropic's `stop_sequence` wants)."""
    return turn_facts(family, result.finish_reason, result.prompt_tokens, result.cached_tokens, result.output_ids,
                      message, stop)


def turn_facts(family: ModelFamily, finish_reason: dict[str, Any], prompt_tokens: int, cached_tokens: int,
               output_ids: np.ndarray, message: dict[str, Any], stop: list[str] | None = None) -> ReplyFacts:
    """`reply_facts` from the fields a stored turn record keeps as well (GET /v1/responses/{id})."""
    kind = finish_reason.get("type")
    matched = finish_reason.get("matched")
    ending: Ending
    stop_sequence = None
    if kind == "length":
        ending = "length"
    elif message.get("tool_calls"):
        ending = "tool_calls"
    elif isinstance(matched, str) and stop and matched in stop:
        ending, stop_sequence = "stop_sequence", matched
    else:
        ending = "stop"
    return ReplyFacts(
        ending=ending, stop_sequence=stop_sequence, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        completion_tokens=len(output_ids),
        reasoning_tokens=reasoning_token_count(family, output_ids, message.get("reasoning_content")),
    )


def whole_delta(message: dict[str, Any]) -> dict[str, Any]:
    """A committed assistant message as the one delta a plain reply is built from."""
    delta: dict[str, Any] = {}
    if message.get("reasoning_content"):
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("content"):
        delta["content"] = message["content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
    return delta


def sse_event(name: str | None, payload: Any) -> bytes:
    """One server-sent event: `event: NAME` (Responses and Anthropic name every event; Claude Code needs the line)
    and one `data:` line of JSON."""
    data = b"data: " + _encoder.encode(payload) + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data


def encode_json(payload: Any) -> bytes:
    return _encoder.encode(payload)
