"""The Anthropic Messages reply: content blocks and the message object, built from the assistant message of the
turn, and the stream events that build the same message block by block.

As for Responses, one builder serves both: a plain reply is the builder fed the whole message as one delta, a
stream feeds it the deltas chat streaming computes. Blocks are `thinking` (with an opaque `signature`, as clients
expect one), `text`, then one `tool_use` per call whose `id` is the stored tool call's id and whose `input` is the
parsed arguments. Anthropic blocks are strictly sequential (one open at a time), so text the model writes after a
call is a second text block in a stream; the committed turn is the same either way.

`stop_reason`: `end_turn`, `max_tokens`, `tool_use`, or `stop_sequence` with the matched `stop_sequence`. `usage`
follows Anthropic's split: `input_tokens` are the prompt tokens the engine did not have cached,
`cache_read_input_tokens` those it had, `output_tokens_details.thinking_tokens` the reasoning's share.
"""

from __future__ import annotations

import json
from typing import Any

from session_server.frontend.reply_facts import ReplyFacts, sse_event, whole_delta

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}


def usage(facts: ReplyFacts) -> dict[str, Any]:
    return {
        "input_tokens": max(0, facts.prompt_tokens - facts.cached_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": facts.cached_tokens,
        "output_tokens": facts.completion_tokens,
        "output_tokens_details": {"thinking_tokens": facts.reasoning_tokens},
    }


class MessageBuilder:
    def __init__(self, rid: str, model: str) -> None:
        self.id = f"msg_{rid}"
        self.rid = rid
        self.model = model
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the thinking or text block being filled
        self.final: dict[str, Any] = {}  # the finished message object (set by `finish`)

    def message(self, facts: ReplyFacts | None, prompt_tokens: int = 0) -> dict[str, Any]:
        if facts is None:  # message_start: nothing is known yet but the prompt's length
            return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 0, "output_tokens": 0}}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [dict(block) for block in self.blocks], "stop_reason": STOP_REASONS[facts.ending],
                "stop_sequence": facts.stop_sequence, "usage": usage(facts)}

    # -- events -----------------------------------------------------------------------------------------------------

    def start(self, prompt_tokens: int) -> list[bytes]:
        """`message_start` and a `ping`: the stream's first bytes."""
        return [sse_event("message_start", {"type": "message_start", "message": self.message(None, prompt_tokens)}),
                sse_event("ping", {"type": "ping"})]

    def _start_block(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.blocks.append(block)
        empty = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        if block["type"] == "thinking":
            empty["signature"] = ""
        return [*events, sse_event("content_block_start", {"type": "content_block_start",
                                                           "index": len(self.blocks) - 1, "content_block": empty})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                 "delta": delta})

    def _close(self) -> list[bytes]:
        block, self.open = self.open, None
        if block is None:
            return []
        events = []
        if block["type"] == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        index = self.blocks.index(block)
        return [*events, sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _fill(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = f"session-server.{self.rid}"
            events += self._start_block(block)
            self.open = block
        self.open[kind] += text
        return [*events, self._delta({"type": f"{kind}_delta", kind: text})]

    def delta(self, delta: dict[str, Any] | None) -> list[bytes]:
        """Events for one chat delta (`reasoning_content`, `content`, `tool_calls`)."""
        if not delta:
            return []
        events: list[bytes] = []
        if delta.get("reasoning_content"):
            events += self._fill("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._fill("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            function = call["function"]
            block = {"type": "tool_use", "id": call["id"], "name": function["name"],
                     "input": json.loads(function["arguments"])}
            events += self._start_block(block)
            events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            events.append(sse_event("content_block_stop", {"type": "content_block_stop",
                                                           "index": len(self.blocks) - 1}))
        return events

    def finish(self, rest: dict[str, Any] | None, facts: ReplyFacts) -> list[bytes]:
        """The rest of the message, the open block closed, `message_delta` (stop reason, final usage) and
        `message_stop`."""
        events = self.delta(rest)
        if not self.blocks:  # an empty reply is still one (empty) text block: clients expect a block
            events += self._start_block({"type": "text", "text": ""})
            self.open = self.blocks[-1]
        events += self._close()
        self.final = self.message(facts)
        end = {"type": "message_delta",
               "delta": {"stop_reason": self.final["stop_reason"], "stop_sequence": facts.stop_sequence},
               "usage": self.final["usage"]}
        return [*events, sse_event("message_delta", end), sse_event("message_stop", {"type": "message_stop"})]


def message_body(rid: str, model: str, message: dict[str, Any], facts: ReplyFacts) -> dict[str, Any]:
    """The plain (non-streamed) message object of a turn."""
    builder = MessageBuilder(rid, model)
    builder.finish(whole_delta(message), facts)
    return builder.final
