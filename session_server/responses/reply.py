"""The Responses reply: output items and the response object, built from the assistant message of the turn, and the
stream events that build the same object piece by piece.

One builder serves both: a plain reply is the builder fed the whole message as one delta, a stream feeds it the
deltas chat streaming computes (stream_parser.DeltaTracker: reasoning, content, whole tool calls). So the object
in `response.completed` is, item for item, what a plain reply of the same turn holds: `reasoning` (its text in
`content`, repeated in `summary` when the request asked for one, and as `encrypted_content` for stateless
clients), an assistant `message` with one `output_text`, then one `function_call` per call, whose `call_id` is the
stored tool call's id (so the echo matches the history). Should the model write text after a call, the stream
shows it as a second message item; the committed turn is the same either way.

Events carry `sequence_number`s from 0, and each item is announced (`output_item.added`), filled (`*.delta`) and
closed (`*.done`, `output_item.done` with the whole item) in order -- Codex reads only the closed items.

With token ids asked for (frontend/token_ids.py), the last output item of the finished response carries the turn's
`prompt_token_ids`, `generation_token_ids` and `generation_log_probs`, as NeMo Gym's model servers attach them to the
last item of each model call (its `*ForTraining` item types); the items' events before it carry none.
"""

from __future__ import annotations

from typing import Any

from session_server.frontend.reply_facts import ReplyFacts, sse_event, turn_facts, whole_delta
from session_server.frontend.token_ids import TurnTokens
from session_server.responses.protocol import RESPONSE_PREFIX, ResponsesTurn, encode_reasoning_state, turn_of_response
from trajectory import LinearTrajectory


def _usage(facts: ReplyFacts) -> dict[str, Any]:
    return {
        "input_tokens": facts.prompt_tokens,
        "input_tokens_details": {"cached_tokens": facts.cached_tokens},
        "output_tokens": facts.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": facts.reasoning_tokens},
        "total_tokens": facts.total_tokens,
    }


class ResponseBuilder:
    def __init__(self, rid: str, model: str, created: int, turn: ResponsesTurn) -> None:
        self.id = f"{RESPONSE_PREFIX}{rid}"
        self.rid = rid
        self.model = model
        self.created = created
        self.turn = turn
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being filled
        self.sequence = 0
        self.messages = 0
        self.final: dict[str, Any] = {}  # the finished response object (set by `finish`)

    # -- the response object ----------------------------------------------------------------------------------------

    def response(self, status: str, facts: ReplyFacts | None = None) -> dict[str, Any]:
        echo = self.turn.echo
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
            "metadata": echo.get("metadata") or {}, "model": self.model, "output": list(self.items),
            "parallel_tool_calls": echo.get("parallel_tool_calls") is not False,
            "previous_response_id": echo.get("previous_response_id"),
            "reasoning": echo.get("reasoning") or {"effort": None, "summary": None},
            "store": echo.get("store") is not False, "temperature": echo.get("temperature"),
            "text": echo.get("text") or {"format": {"type": "text"}},
            "tool_choice": echo.get("tool_choice") or "auto", "tools": echo.get("tools") or [],
            "top_p": echo.get("top_p"), "truncation": "disabled", "user": echo.get("user"),
            "usage": _usage(facts) if facts is not None else None,
        }

    # -- events -----------------------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(kind, payload)

    def start(self) -> list[bytes]:
        """`response.created` and `response.in_progress`: the stream's first bytes."""
        skeleton = self.response("in_progress")
        return [self._event("response.created", response=skeleton),
                self._event("response.in_progress", response=skeleton)]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if self.turn.reasoning_summary:
                events += [
                    self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                    self._event("response.reasoning_summary_part.done", **where, summary_index=0,
                                part=item["summary"][0]),
                ]
            if self.turn.encrypted_reasoning:
                item["encrypted_content"] = encode_reasoning_state(text)
            events += [self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                       self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        else:
            part = item["content"][0]
            events += [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                   logprobs=[]),
                       self._event("response.content_part.done", **where, content_index=0, part=part)]
        return [*events, self._event("response.output_item.done", **where, item=item)]

    def _reasoning(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        item = self.open
        if item is None or item["type"] != "reasoning":
            events += self._close()
            item = {"id": f"rs_{self.rid}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            self.open = item
            events += self._add(item)
            where = {"item_id": item["id"], "output_index": len(self.items) - 1}
            if self.turn.reasoning_summary:
                item["summary"].append({"type": "summary_text", "text": ""})
                events.append(self._event("response.reasoning_summary_part.added", **where, summary_index=0,
                                          part={"type": "summary_text", "text": ""}))
            item["content"].append({"type": "reasoning_text", "text": ""})
            events.append(self._event("response.content_part.added", **where, content_index=0,
                                      part={"type": "reasoning_text", "text": ""}))
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        item["content"][0]["text"] += text
        if self.turn.reasoning_summary:
            item["summary"][0]["text"] += text
            events.append(self._event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text))
        events.append(self._event("response.reasoning_text.delta", **where, content_index=0, delta=text))
        return events

    def _text(self, text: str) -> list[bytes]:
        events: list[bytes] = []
        item = self.open
        if item is None or item["type"] != "message" or not text:
            events += self._close()
            self.messages += 1
            item_id = f"msg_{self.rid}" if self.messages == 1 else f"msg_{self.rid}_{self.messages}"
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            self.open = item
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item_id,
                                      output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        if not text:  # an empty reply is still one (empty) message, so that its echo is a turn
            return events
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self.items.index(item), content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, index: int, call: dict[str, Any]) -> list[bytes]:
        events = self._close()
        function = call["function"]
        item = {"id": f"fc_{self.rid}_{index}", "type": "function_call", "call_id": call["id"],
                "name": function["name"], "arguments": "", "status": "in_progress"}
        namespace = self.turn.namespaces.get(function["name"])
        if namespace is not None:
            item["namespace"] = namespace
        events += self._add(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["arguments"] = function["arguments"]
        events += [
            self._event("response.function_call_arguments.delta", **where, delta=function["arguments"]),
            self._event("response.function_call_arguments.done", **where, name=function["name"],
                        arguments=function["arguments"]),
        ]
        item["status"] = "completed"
        return [*events, self._event("response.output_item.done", **where, item=item)]

    def delta(self, delta: dict[str, Any] | None) -> list[bytes]:
        """Events for one chat delta (`reasoning_content`, `content`, `tool_calls` with their `index`)."""
        if not delta:
            return []
        events: list[bytes] = []
        if delta.get("reasoning_content"):
            events += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call["index"], call)
        return events

    def finish(self, rest: dict[str, Any] | None, facts: ReplyFacts, tokens: TurnTokens | None = None) -> list[bytes]:
        """The rest of the message, every item closed, then `response.completed` (or `response.incomplete` when the
        reply ran out of `max_output_tokens`) with the whole response object; `tokens` go on its last item."""
        events = self.delta(rest)
        if not self.items:
            events += self._text("")
        events += self._close()
        if tokens is not None:
            self.items[-1] = {**self.items[-1], "prompt_token_ids": tokens.prompt_token_ids,
                              "generation_token_ids": tokens.token_ids, "generation_log_probs": tokens.log_probs}
        status = "incomplete" if facts.ending == "length" else "completed"
        self.final = self.response(status, facts)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.final)]


def response_body(rid: str, model: str, created: int, turn: ResponsesTurn, message: dict[str, Any],
                  facts: ReplyFacts, tokens: TurnTokens | None = None) -> dict[str, Any]:
    """The plain (non-streamed) response object of a turn."""
    builder = ResponseBuilder(rid, model, created, turn)
    builder.finish(whole_delta(message), facts, tokens)
    return builder.final


def stored_response(trajectory: LinearTrajectory, response_id: str) -> dict[str, Any]:
    """GET /v1/responses/{id}: the response of a committed turn, rebuilt from its record (the request's echo
    fields are not kept, only what the turn produced)."""
    k = turn_of_response(trajectory, response_id)
    record = trajectory.records[k]
    ids, _ = trajectory.turn_tokens(k)
    family = trajectory.family
    facts = turn_facts(family, record.finish_reason, record.prompt_tokens, record.cached_tokens,
                       ids[record.prompt_len:], record.message)
    return response_body(record.rid or "", family.name, 0, ResponsesTurn(chat={}), record.message, facts)
