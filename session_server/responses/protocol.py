"""The OpenAI Responses request, mapped onto the chat turn every API shares.

A Responses request says in items what a chat request says in messages: `instructions` and `developer`/`system`
items are system messages, `message` items user or assistant messages, and one assistant turn is a run of items --
`reasoning`, an assistant `message`, `function_call`s -- which becomes one assistant message with `reasoning_content`
and `tool_calls`, exactly as the turn was stored (the tool call's `call_id` is the stored tool call's id). So the
matcher sees the same history whichever API carried it, and the appended messages render to the same template
tokens (tests/unit/session_server/frontend/test_api_mapping.py proves it against the chat form).

The result is a Chat Completions request object (`ResponsesTurn.chat`), validated further by the chat front end's
own parser (sampling bounds, tool schemas, tool_choice against the tools), so every API honours a field the same
way. What this API adds is checked here, with this API's field names in the 400s: flat function tools,
`text.format`, `reasoning.effort` (the family's thinking switch), `max_output_tokens`, `include`. Which keys are
mapped here, which are accepted without changing the tokens (`store`, `metadata`, `prompt_cache_key`, ...; reported
in `ignored`) and which are refused is the table RESPONSES_KEYS (frontend/fields.py); anything this server cannot
honour is a 400 that names it. Pure: no I/O.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from session_server.errors import SessionNotFoundError
from session_server.frontend.chat_request import read_chat
from session_server.frontend.fields import RESPONSES_KEYS, RESPONSES_TEXT_KEYS, reply_limit
from session_server.frontend.request_items import bad, non_empty_string, objects
from session_server.http.body import decode_object
from session_server.turns.turn import TurnRequest
from trajectory import LinearTrajectory
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits

ENCRYPTED_REASONING = "reasoning.encrypted_content"
RESPONSE_PREFIX = "resp_"  # a response id is `resp_<rid>` of the committed turn that answered it
# The reasoning text travels back and forth in `encrypted_content` for clients that keep no server state
# (`store: false`): encoded, not encrypted -- there is no secret to keep from the agent that generated it.
_REASONING_STATE = "session-server-reasoning.v1."


def encode_reasoning_state(text: str) -> str:
    return _REASONING_STATE + base64.urlsafe_b64encode(text.encode()).decode("ascii")


def decode_reasoning_state(blob: Any) -> str | None:
    if not isinstance(blob, str) or not blob.startswith(_REASONING_STATE):
        return None
    try:
        return base64.urlsafe_b64decode(blob[len(_REASONING_STATE):].encode("ascii")).decode()
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(slots=True)
class ResponsesTurn:
    """One Responses request as the shared turn sees it, plus what only the Responses reply needs."""

    chat: dict[str, Any]                       # a Chat Completions request object (messages, tools, sampling)
    previous_response_id: str | None = None
    encrypted_reasoning: bool = False          # include: ["reasoning.encrypted_content"]
    reasoning_summary: bool = False            # reasoning.summary set: the reasoning is also given as a summary
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace tool
    ignored: list[str] = field(default_factory=list)   # accepted fields without effect on the tokens


def _image_part(where: str, part: dict[str, Any]) -> dict[str, Any]:
    """An `input_image` as the chat `image_url` part every API's images become (frontend/images.py reads it, naming
    `where`); a `file_id` needs the Files API, which this server does not have."""
    url = part.get("image_url")
    if part.get("file_id") is not None or not isinstance(url, str):
        raise bad(where, "must be an input_image with an 'image_url' (a base64 data URL); file_id is not supported")
    return {"type": "image_url", "image_url": {"url": url}, "where": where}


def _text_parts(where: str, content: Any, kinds: tuple[str, ...], images: bool = False) -> str | list[dict[str, Any]]:
    """The text of a string or a list of text parts (`input_text`, `output_text`, ...); with `images` (a user
    message, a function call's output) the chat parts, images included, when there is an `input_image`. Files and
    audio are 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", "must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            parts.append(_image_part(f"{where}.content[{j}]", part))
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{where}.content[{j}]", f"is {kind}: not supported here")
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{j}]", f"must be one of {', '.join(kinds)} with a 'text' string")
        parts.append({"type": "text", "text": part["text"]})
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _text(where: str, content: Any, kinds: tuple[str, ...]) -> str:
    text = _text_parts(where, content, kinds)
    assert isinstance(text, str)  # no images asked for: text
    return text


class _Turns:
    """Builds chat messages from items, merging each run of assistant-side items into one assistant message."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.assistant: dict[str, Any] | None = None

    def flush(self) -> None:
        if self.assistant is not None:
            self.messages.append(self.assistant)
            self.assistant = None

    def add(self, message: dict[str, Any]) -> None:
        self.flush()
        self.messages.append(message)

    def open_assistant(self, new_turn: bool = False) -> dict[str, Any]:
        if self.assistant is not None and new_turn and (self.assistant["content"] or "tool_calls" in self.assistant):
            self.flush()  # a reasoning item after text or calls opens the next turn
        if self.assistant is None:
            self.assistant = {"role": "assistant", "content": ""}
        return self.assistant


def _reasoning_text(where: str, item: dict[str, Any]) -> str | None:
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad(f"{where}.{key}", "must be a list")
        found = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if found:  # the full reasoning is in `content`; `summary` repeats it when a summary was asked for
            texts = found
            break
    if texts:
        return "\n".join(texts)
    return decode_reasoning_state(item.get("encrypted_content"))


def _item(turns: _Turns, where: str, item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role in ("user", "system", "developer"):
            content = _text_parts(where, item.get("content"), ("input_text",), images=role == "user")
            turns.add({"role": "user" if role == "user" else "system", "content": content})
        elif role == "assistant":
            text = _text(where, item.get("content"), ("output_text", "refusal", "input_text"))
            message = turns.open_assistant()
            message["content"] += text
        else:
            raise bad(f"{where}.role", f"must be 'user', 'assistant', 'system' or 'developer', got {role!r}")
    elif kind == "function_call":
        call_id, name = non_empty_string(item, "call_id", where), non_empty_string(item, "name", where)
        arguments = item.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise bad(f"{where}.arguments", "must be a JSON string")
        message = turns.open_assistant()
        message.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    elif kind == "function_call_output":
        call_id = non_empty_string(item, "call_id", where)
        output = _text_parts(where, item.get("output"), ("input_text", "output_text"), images=True)
        turns.add({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "reasoning":
        reasoning = _reasoning_text(where, item)
        message = turns.open_assistant(new_turn=True)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
    elif kind == "item_reference":
        raise bad(f"{where}.type", "item_reference is not supported: send the items, or previous_response_id")
    else:
        raise bad(f"{where}.type", f"{kind!r} is not supported (message, function_call, function_call_output, "
                                   "reasoning)")


def input_messages(input_: Any, instructions: Any, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Chat messages of `instructions` + the stored `history` (previous_response_id) + `input`.

    With a history, `instructions` replace its leading system message (OpenAI does not carry instructions over
    from the previous response): the same instructions leave the history as it is.
    """
    head: list[dict[str, Any]] = list(history or [])
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "must be a string")
        if head and head[0]["role"] == "system":
            head = head[1:]
        head.insert(0, {"role": "system", "content": instructions})
    turns = _Turns()
    if isinstance(input_, str):
        turns.add({"role": "user", "content": input_})
    elif isinstance(input_, list):
        for where, item in objects(input_, "input"):
            _item(turns, where, item)
        turns.flush()
    else:
        raise bad("input", "must be a string or a list of items")
    return head + turns.messages


# Tools the API runs on its own servers: nothing a local model can call, so they are not rendered (counted).
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                          "computer_use_preview", "mcp", "local_shell"})


def _function(where: str, tool: dict[str, Any]) -> dict[str, Any]:
    non_empty_string(tool, "name", where)
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tools(tools: Any, ignored: list[str], namespaces: dict[str, str]) -> list[dict[str, Any]] | None:
    """Flat function tools -> chat tools, key order kept (templates write schemas with `tojson`). A `namespace`
    tool's functions become tools of their own (`namespaces` remembers whose they are, for the reply's calls);
    hosted tools are reported in `ignored`."""
    if tools is None:
        return None
    out = []
    for where, tool in objects(tools, "tools"):
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(where, tool))
        elif kind == "namespace":
            namespace = non_empty_string(tool, "name", where)
            for member_where, member in objects(tool.get("tools"), f"{where}.tools"):
                if member.get("type", "function") != "function":
                    raise bad(f"{member_where}.type", "only function tools may be members of a namespace")
                out.append(_function(member_where, member))
                namespaces[member["name"]] = namespace
        elif kind in HOSTED_TOOLS:
            ignored.append(f"tools.{kind}")
        else:
            raise bad(f"{where}.type", f"{kind!r} is not supported: function and namespace tools only")
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": non_empty_string(choice, "name", "tool_choice")}}
    raise bad("tool_choice", "must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}")


def _response_format(text: Any, ignored: list[str]) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "must be an object")
    ignored += RESPONSES_TEXT_KEYS.read(text, "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise bad("text.format.schema", "is required for a json_schema format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _reasoning(reasoning: Any, thinking_switch: str | None, ignored: list[str]) -> tuple[dict[str, Any] | None, bool]:
    """(chat_template_kwargs, summary wanted): effort 'none' turns the family's thinking switch off, any other
    effort on (a level is nothing a template expresses; `max_output_tokens` bounds the reply). A family without a
    switch reports the effort as ignored."""
    if reasoning is None:
        return None, False
    if not isinstance(reasoning, dict):
        raise bad("reasoning", "must be an object")
    effort = reasoning.get("effort")
    if effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad("reasoning.effort", f"must be none, minimal, low, medium, high or xhigh, got {effort!r}")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary not in (None, "auto", "concise", "detailed"):
        raise bad("reasoning.summary", f"must be auto, concise or detailed, got {summary!r}")
    kwargs = None
    if effort is not None:
        if thinking_switch is not None:
            kwargs = {thinking_switch: effort != "none"}
        else:
            ignored.append("reasoning.effort")
    return kwargs, summary is not None


def _include(include: Any) -> bool:
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("include", "must be a list of strings")
    for value in include:
        if value != ENCRYPTED_REASONING:
            raise bad("include", f"value {value!r} is not supported (only {ENCRYPTED_REASONING!r})")
    return ENCRYPTED_REASONING in include


def parse_responses(obj: dict[str, Any], thinking_switch: str | None,
                    history: list[dict[str, Any]] | None = None) -> ResponsesTurn:
    """Map a decoded Responses request onto the chat turn; `history` is the stored conversation up to
    `previous_response_id` (resolved by the caller, which owns the session)."""
    ignored = RESPONSES_KEYS.read(obj)
    previous = obj.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad("previous_response_id", "must be a string")
    max_output = reply_limit(obj.get("max_output_tokens"), "max_output_tokens")
    template_kwargs, summary = _reasoning(obj.get("reasoning"), thinking_switch, ignored)
    namespaces: dict[str, str] = {}
    chat: dict[str, Any] = {
        "messages": input_messages(obj.get("input"), obj.get("instructions"), history),
        "tools": chat_tools(obj.get("tools"), ignored, namespaces),
        "tool_choice": chat_tool_choice(obj.get("tool_choice")),
        "parallel_tool_calls": obj.get("parallel_tool_calls"),
        "max_tokens": max_output,
        "temperature": obj.get("temperature"),
        "top_p": obj.get("top_p"),
        "response_format": _response_format(obj.get("text"), ignored),
        "chat_template_kwargs": template_kwargs,
        "stream": obj.get("stream"),
        "model": obj.get("model"),
        "return_token_ids": obj.get("return_token_ids"),  # NeMo Gym's token fields on the output (reply.py)
    }
    echo = {key: obj.get(key) for key in ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
                                          "previous_response_id", "reasoning", "store", "temperature", "text",
                                          "tool_choice", "tools", "top_p", "user")}
    return ResponsesTurn(
        chat={k: v for k, v in chat.items() if v is not None}, previous_response_id=previous,
        encrypted_reasoning=_include(obj.get("include")), reasoning_summary=summary, echo=echo, ignored=ignored,
        namespaces=namespaces,
    )


def turn_of_response(trajectory: LinearTrajectory, response_id: str) -> int:
    """The index of the committed turn that answered `response_id`, else a 404."""
    if response_id.startswith(RESPONSE_PREFIX):
        rid = response_id[len(RESPONSE_PREFIX):]
        for k, record in enumerate(trajectory.records):
            if record.rid == rid:
                return k
    raise SessionNotFoundError(f"response {response_id} is not a turn of this session")


def parse_request(body: bytes, trajectory: LinearTrajectory,
                  images: ImageLimits = NO_IMAGE_LIMITS) -> TurnRequest[ResponsesTurn]:
    """A Responses body as the turn's request, with `previous_response_id` resolved on the session's own
    trajectory: the history it continues is the trajectory's messages up to that turn's checkpoint (the matcher
    meets the stored messages themselves and appends: nothing is re-rendered)."""
    obj = decode_object(body)
    previous = obj.get("previous_response_id")
    history = None
    if isinstance(previous, str):
        turn = turn_of_response(trajectory, previous)
        history = trajectory.messages[: trajectory.checkpoints[turn].num_messages]
    mapped = parse_responses(obj, trajectory.family.thinking_switch, history)
    request = read_chat(mapped.chat, trajectory.family, mapped, images, trajectory.images)
    request.ignored = mapped.ignored
    return request
