"""gpt-oss: OpenAI's harmony format. A reply is a sequence of messages on channels, not one message.

What the model writes after the generation prompt `<|start|>assistant`: its reasoning on the `analysis` channel
(`<|channel|>analysis<|message|>...<|end|>`), then either its answer on `final` (`<|start|>assistant<|channel|>final
<|message|>...`, ended by `<|return|>`) or one tool call on `commentary` addressed to the function
(`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, ended by `<|call|>`),
optionally after a `commentary` preamble. Harmony makes one call per completion: `<|call|>` is a stop token.

What that means for TITO:
- `<|end|>` ends every message in history but is not a stop token (the reply goes on after its reasoning):
  `eos_is_stop` is False.
- `<|call|>` is both a stop token and what the template writes after a call, so a reply ending on it is closed as it
  is; `<|return|>` is written `<|end|>` in history, so a reply ending on it has it replaced (max_trim 1).
- A tool result is authored by `functions.NAME`: its name comes from the call it answers, which for an appended
  result is in the stored history (`appended_messages` names it).

Parsing follows SGLang 0.5.23's harmony parser (`gpt-oss` reasoning parser and tool-call detector): analysis is the
reasoning, `final` and recipient-less `commentary` the content, a `commentary` message to `functions.NAME` a call
whose JSON arguments must parse (an empty body is `{}`); a message cut before its end keeps its text when it is
reasoning or an answer and is dropped when it is on `commentary`. The engine's text may or may not end with
`<|call|>` (SGLang keeps it when it runs with `--tool-call-parser gpt-oss`): both read the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import ModelFamily, ParsedCompletion, ToolCall, tool_call_from_json

START = "<|start|>"
ASSISTANT = START + "assistant"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
CONSTRAIN_JSON = "<|constrain|>json"
_MESSAGE_RE = re.compile(
    rf"(?:{re.escape(ASSISTANT)})?(?P<header>(?:(?!{re.escape(MESSAGE)}|{re.escape(START)}).)*?){re.escape(MESSAGE)}"
    rf"(?P<body>.*?)(?P<end>{re.escape(END)}|{re.escape(CALL)}|{re.escape(RETURN)}|\Z)", re.DOTALL)
_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT_RE = re.compile(r"to=([A-Za-z_][A-Za-z0-9_.\-]*)")


def _call(recipient: str, body: str) -> ToolCall | None:
    try:
        arguments = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError):
        return None
    return tool_call_from_json(recipient.rsplit(".", 1)[-1], arguments)


def parse(text: str) -> ParsedCompletion:
    """Harmony messages -> reasoning (analysis), content (final, commentary preambles) and calls."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    seen_analysis = False
    while pos < len(text):
        match = _MESSAGE_RE.match(text, pos)
        channel = _CHANNEL_RE.search(match.group("header")) if match else None
        if match is None or channel is None:
            rest = text[pos:]  # a header cut short is dropped; text that is no header is an answer
            if not (rest.startswith("<|") or "<|".startswith(rest) or ASSISTANT.startswith(rest)):
                content.append(rest)
            break
        pos = match.end()
        body, closed = match.group("body"), bool(match.group("end"))
        recipient = _RECIPIENT_RE.search(match.group("header"))
        if channel.group(1) == "analysis" and recipient is None:
            reasoning.append(body)
            seen_analysis = True
        elif recipient is not None:
            # Unclosed at the end of the text: the engine dropped the `<|call|>` stop token, or the reply was cut; an
            # empty body there is a cut one (SGLang finds no call in it either).
            call = _call(recipient.group(1), body) if closed or (pos == len(text) and body.strip()) else None
            if call is not None:
                calls.append(call)
        elif channel.group(1) == "final" or (channel.group(1) == "commentary" and closed):
            content.append(body)
    return ParsedCompletion(content="".join(content), reasoning_content="".join(reasoning) if seen_analysis else None,
                            tool_calls=calls)


def _format_message(header: str, body: str) -> str:
    return f"{ASSISTANT}{header}{MESSAGE}{body}"


class GptOssFamily(ModelFamily):
    name = "gpt-oss"
    eos_token = END
    eos_is_stop = False
    extra_stop_tokens = (RETURN, CALL, "<|endoftext|>")
    closing_stop_tokens = (CALL,)
    message_trailer = ""
    assistant_header = ASSISTANT
    # A later system message renders as a developer message.
    appendable_roles = frozenset({"user", "tool", "system", "assistant"})
    tools_only_in_preamble = True  # the tools are a namespace in the developer message, and a line of the system one
    structural_tag_format = "harmony"  # SGLang's gpt-oss detector: xgrammar's harmony tag
    thinking_default = True  # always reasons on `analysis` (SGLang: the template's channels make it "always")
    sglang_reasoning_parser = "gpt-oss"
    # Harmony's reasoning effort is a template variable (`chat_template_kwargs: {"reasoning_effort": "high"}`), not a
    # switch: the model always reasons. Streaming sends the analysis and final messages as they arrive, once their
    # header is whole (`stream_settled`), and holds a commentary message back until it ends; every special token
    # starts with `<|`, the one spelling past which plain text may change meaning.
    stream_markers = ("<|",)

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._call_id, self._return_id = self._single_id(CALL), self._single_id(RETURN)
        self._message_id = self._single_id(MESSAGE)
        self._message_ends = frozenset({self.eos_token_id, self._call_id, self._return_id})

    def appended_messages(self, messages: Sequence[Mapping[str, Any]], start: int) -> list[dict[str, Any]]:
        """Tool results named as the template names them: by `tool_call_id`, else by position among the calls of the
        last stored assistant message (when no appended assistant message comes before them)."""
        names: dict[Any, str] = {}
        last_calls: list[str] = []
        for message in messages[:start]:
            if message.get("role") == "assistant":
                last_calls = [call["function"]["name"] for call in message.get("tool_calls") or ()]
                names.update({call.get("id"): call["function"]["name"] for call in message.get("tool_calls") or ()})
        appended = super().appended_messages(messages, start)
        for answered, message in enumerate(appended):
            if message.get("role") != "tool":
                break  # a later tool result answers an appended assistant message, which the template sees itself
            name = message.get("name") or names.get(message.get("tool_call_id"))
            if not name and answered < len(last_calls):
                name = last_calls[answered]
            if name:
                message["name"] = name
        return appended

    def reasoning_end(self, output_ids: Sequence[int] | Any) -> int:
        """Through the last analysis message (its `<|end|>` included; all of a reply cut inside one): each message's
        header, the few ids before its `<|message|>`, names its channel."""
        ids = [int(i) for i in output_ids]
        end = start = 0
        for pos, token in enumerate([*ids, None]):
            if token is not None and token not in self._message_ends:
                continue
            segment = ids[start:pos]
            body = segment.index(self._message_id) if self._message_id in segment else len(segment)
            header = self.decode(segment[:body])
            channel = _CHANNEL_RE.search(header)
            if channel is not None and channel.group(1) == "analysis" and not _RECIPIENT_RE.search(header):
                end = min(pos + 1, len(ids))
            start = pos + 1
        return end

    def stream_settled(self, text: str) -> tuple[int, bool]:
        """Up to the end of the last whole message, or into the body of an analysis or final message whose header is
        whole (a trailing `<|` that may open a token held back); a commentary message, or text before any header, is
        held back whole."""
        ended = max(((text.rfind(end), end) for end in (END, CALL, RETURN)), default=(-1, END))
        start = ended[0] + len(ended[1]) if ended[0] >= 0 else 0
        body = text.find(MESSAGE, start)
        if body < 0:
            return start, start < len(text)
        header = text[start:body]
        channel = _CHANNEL_RE.search(header)
        if channel is None or channel.group(1) not in ("analysis", "final") or _RECIPIENT_RE.search(header):
            return start, True
        partial = text.rfind("<|", body + len(MESSAGE))
        if partial >= 0 and "|>" not in text[partial:]:
            return partial, False
        return len(text) - text.endswith("<"), False

    def open_message_end(self, message: Mapping[str, Any]) -> str:
        return CALL if message.get("tool_calls") else END

    def stop_token_after(self, text: str) -> int:
        return self._call_id if parse(text).tool_calls else self._return_id

    def split_reasoning(self, text: str) -> tuple[str | None, str]:
        parsed = parse(text)
        rest = text
        if parsed.reasoning_content is not None:  # everything after the analysis messages, as the model wrote it
            last = text.rfind(f"{CHANNEL}analysis{MESSAGE}")
            end = text.find(END, last)
            rest = "" if end < 0 else text[end + len(END):]
        return parsed.reasoning_content, rest

    def parse_completion(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedCompletion:
        return parse(text)

    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: Sequence[tuple[str, str]]) -> str:
        messages = [] if reasoning_content is None else [_format_message(f"{CHANNEL}analysis", reasoning_content)]
        if tool_calls:
            if content:
                messages.append(_format_message(f"{CHANNEL}commentary", content))
            calls = [_format_message(f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN_JSON}", arguments)
                     for name, arguments in tool_calls]
            messages.append(CALL.join(calls))
        else:
            messages.append(_format_message(f"{CHANNEL}final", content))
        return END.join(messages).removeprefix(ASSISTANT)
