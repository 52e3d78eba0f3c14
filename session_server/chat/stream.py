"""`stream: true` chats as OpenAI writes them: chat.completion.chunk events, then `finish_reason`, a usage chunk with
empty `choices` when `stream_options.include_usage`, and `[DONE]`; an error after the first byte is an error chunk
(frontend/errors.py).

With token ids asked for (frontend/token_ids.py) the first chunk carries `prompt_token_ids`, as vLLM's does, and the
finishing chunk carries them again with the choice's `token_ids`: every token of the reply at once, as it is
committed (the chunks before carry none, so a client that joins the chunks' `token_ids` gets the reply's too). A turn
on a LoRA adapter revision names it on the finishing chunk's choice as a plain reply does (policy_spans.py): ART
joins the chunks' spans and, tracking policies, refuses a stream without them.

The streamed turn itself is the turn's engine call (turns/engine_call.py: the engine stream, the commit, every
failure rule) and turns/stream.py (the deltas); this only formats what they hand over, the same facts a plain reply
is built from (reply.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from session_server.chat.logprobs import openai_logprobs
from session_server.chat.policy_spans import policy_token_spans
from session_server.chat.reply import finish_reason, system_fingerprint, usage
from session_server.frontend.chat_request import ChatRequest
from session_server.frontend.errors import chat_stream_error
from session_server.frontend.reply_facts import reply_facts
from session_server.frontend.token_ids import turn_tokens
from session_server.turns.output import TurnOutput
from session_server.turns.turn import NewTokens, Turn
from trajectory.errors import SessionError

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def _event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class ChatStream:
    """The StreamFormat (turns/turn.py) of Chat Completions."""

    def __init__(self, turn: Turn[ChatRequest]) -> None:
        self.turn = turn
        self.options = turn.request.api.options
        self.id = f"chatcmpl-{turn.rid}"

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
               fingerprint: str | None = None, prompt_ids: list[int] | None = None,
               token_ids: list[int] | None = None, spans: dict[str, Any] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                                  **(spans or {})}
        chunk: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.turn.created, "model": self.turn.model,
            "choices": [choice],
        }
        if fingerprint is not None:
            chunk["system_fingerprint"] = fingerprint
        if prompt_ids is not None:
            chunk["prompt_token_ids"] = prompt_ids
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return _event(chunk)

    def _logprobs(self, tokens: NewTokens | None) -> Any:
        if tokens is None:
            return None
        return openai_logprobs(self.turn.family.tokenizer, tokens.ids, tokens.logprobs, tokens.top,
                               self.options.top_logprobs, self.options.tokens_as_token_ids)

    def start(self) -> list[bytes]:
        # The prompt is known before the engine answers: vLLM's first chunk carries it.
        prompt = self.turn.plan.prompt_ids.tolist() if self.turn.return_token_ids else None
        return [self._chunk({"role": "assistant", "content": ""}, prompt_ids=prompt)]

    def delta(self, delta: dict[str, Any] | None, tokens: NewTokens | None) -> list[bytes]:
        return [self._chunk(delta or {}, logprobs=self._logprobs(tokens))]

    def finish(self, out: TurnOutput, rest: dict[str, Any] | None, tokens: NewTokens | None) -> list[bytes]:
        result = out.result
        fingerprint = system_fingerprint(self.turn.family, result)
        logprobs = self._logprobs(tokens)
        events = []
        if rest is not None:
            events.append(self._chunk(rest, logprobs=logprobs, fingerprint=fingerprint))
            logprobs = None
        ids = turn_tokens(self.turn.return_token_ids, self.turn.plan, out)
        facts = reply_facts(self.turn.family, result, out.message)
        events.append(self._chunk({}, finish=finish_reason(facts), logprobs=logprobs,
                                  fingerprint=fingerprint,
                                  prompt_ids=None if ids is None else ids.prompt_token_ids,
                                  token_ids=None if ids is None else ids.token_ids,
                                  spans=policy_token_spans(self.turn.adapter, self.turn.rid, facts.prompt_tokens,
                                                           facts.completion_tokens)))
        if self.options.include_usage:
            events.append(_event({"id": self.id, "object": "chat.completion.chunk", "created": self.turn.created,
                                  "model": self.turn.model, "system_fingerprint": fingerprint, "choices": [],
                                  "usage": usage(facts)}))
        return events

    def end(self) -> bytes:
        return DONE

    def error(self, err: SessionError) -> list[bytes]:
        return [chat_stream_error(err)]
