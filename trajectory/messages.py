"""Normalising OpenAI chat messages and deciding whether a request repeats the stored history.

Agents echo history back in many equivalent shapes (content as parts, `None` vs `""`, tool-call `index`
fields, dict arguments); normalising once at the boundary keeps every later comparison and template
render simple. Matching decides append-only vs. rollback, so its notion of "equal" is a policy: see
`MessageMatcher`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, get_args

from .errors import RequestValidationError
from .images import IMAGE_MARK, Image

Message = dict[str, Any]
MatcherName = Literal["strict", "loose_tool_call"]
MATCHER_NAMES: tuple[str, ...] = get_args(MatcherName)
ROLES = frozenset({"system", "user", "assistant", "tool"})
# OpenAI's newer name for the system role; chat templates only know "system".
_ROLE_ALIASES = {"developer": "system"}


def _content_text(index: int, content: Any, images: list[str] | None = None) -> str:
    """The text of a string or a list of parts; with `images` (a role that may carry images), each `image` part a
    front end read (session_server/frontend/images.py) becomes `IMAGE_MARK` in the text and its hash in `images`
    (a message without images keeps any U+FDD0 of its text as text: only a message with images is rendered with
    its marks replaced, trajectory/images.py)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if images is not None and isinstance(part, dict) and part.get("type") == "image" \
                    and isinstance(image := part.get("image"), Image):
                parts.append(IMAGE_MARK)
                images.append(image.digest)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestValidationError(
                    f"messages[{index}].content[{j}]: only text parts are supported, got {kind!r}"
                )
            parts.append(part["text"])
        text = "".join(parts)
        if images and text.count(IMAGE_MARK) != len(images):  # a mark in the text would move an image
            raise RequestValidationError(f"messages[{index}].content: text beside an image holds U+FDD0, a reserved "
                                         "noncharacter")
        return text
    raise RequestValidationError(
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _tool_call(index: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{index}].tool_calls[{j}]"
    if not isinstance(call, dict):
        raise RequestValidationError(f"{where} must be an object")
    function = call.get("function")
    if not isinstance(function, dict):
        raise RequestValidationError(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise RequestValidationError(f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        raise RequestValidationError(f"{where}.function.arguments must be a JSON string")
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise RequestValidationError(f"{where}.id must be a string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _copy_optional_string(index: int, message: dict[str, Any], out: Message, key: str) -> None:
    """Copy `message[key]` into `out` when present: absent and null are the same to an agent, anything else but a
    string is a 400."""
    value = message.get(key)
    if value is not None:
        if not isinstance(value, str):
            raise RequestValidationError(f"messages[{index}].{key} must be a string")
        out[key] = value


def normalize_message(index: int, message: Any) -> Message:
    """One canonical shape per message: str content, full tool-call dicts, no transport-only fields."""
    if not isinstance(message, dict):
        raise RequestValidationError(f"messages[{index}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role is None:
        raise RequestValidationError(f"messages[{index}] has no role")
    if not isinstance(role, str):
        raise RequestValidationError(f"messages[{index}].role must be a string, got {type(role).__name__}")
    role = _ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise RequestValidationError(f"messages[{index}] has unknown role {role!r}; expected one of {sorted(ROLES)}")
    content = message.get("content")
    out: Message = {"role": role}
    if role == "assistant":
        out["content"] = "" if content is None else _content_text(index, content)
        _copy_optional_string(index, message, out, "reasoning_content")
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise RequestValidationError(f"messages[{index}].tool_calls must be a list")
            out["tool_calls"] = [_tool_call(index, j, call) for j, call in enumerate(calls)]
        return out
    if content is None:
        raise RequestValidationError(f"messages[{index}] ({role}) has no content")
    images: list[str] = []
    out["content"] = _content_text(index, content, images)
    if images:
        out["images"] = images
    if role == "tool":
        _copy_optional_string(index, message, out, "tool_call_id")
    name = message.get("name")
    if isinstance(name, str) and name:
        out["name"] = name
    return out


def _check_message_list(messages: Any) -> None:
    """Every request carries the whole history, so an empty or non-list `messages` is a 400 before any message."""
    if not isinstance(messages, list) or not messages:
        raise RequestValidationError("messages must be a non-empty list")


def normalize_messages(messages: Any) -> list[Message]:
    _check_message_list(messages)
    return [normalize_message(i, m) for i, m in enumerate(messages)]


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """`None` and `[]` both mean "no tools" (templates render them identically)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestValidationError("tools must be a list")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise RequestValidationError(f"tools[{i}] must be an object with a 'function' object")
        name = tool["function"].get("name")
        if not isinstance(name, str) or not name:
            raise RequestValidationError(f"tools[{i}].function.name must be a non-empty string")
    return tools


def json_equal(a: Any, b: Any) -> bool:
    """Equality of parsed JSON values as JSON sees them: numbers by value (1 == 1.0), but booleans are not numbers
    (Python's `True == 1` would make `{"x": true}` equal `{"x": 1}`) and key order never matters."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _same_arguments(a: str, b: str, loose: bool) -> bool:
    if a == b:
        return True
    if not loose:
        return False
    try:
        return json_equal(json.loads(a), json.loads(b))
    except (ValueError, RecursionError):  # not JSON (or nested past the parser): only the exact text is equal
        return False


# Why a request diverged from the stored history: the label of the rollback counter, header and record.
RollbackReason = Literal[
    "retry", "role", "content", "reasoning_content", "tool_calls", "tool_call_id", "tool_call_arguments"
]
ROLLBACK_REASONS: tuple[str, ...] = get_args(RollbackReason)


class MessageMatcher:
    """Decides whether a request message repeats a stored one.

    Agents re-serialise what they were sent, so by default (`loose_tool_call`) a request message repeats a stored
    one when role and content are equal (`None`/`""`/`[]` are equal and tool-call `index` is ignored: normalisation
    takes care of both), tool calls have the same ids and names, and their arguments are equal as parsed JSON
    (compacted, re-spaced or reordered: `{"key":"x"}` repeats `{"key": "x"}`). `reasoning_content` is compared only
    when the request carries it: OpenAI-SDK agents usually drop reasoning when they echo history, and a missing
    field says nothing about what the model generated. `strict` additionally wants the argument text byte for byte;
    it is there for operators who want any re-serialisation by the agent to show up as a rollback.
    """

    def __init__(self, mode: str = "loose_tool_call") -> None:
        if mode not in MATCHER_NAMES:
            raise ValueError(f"unknown message matcher {mode!r}; expected one of {MATCHER_NAMES}")
        self.mode = mode
        self._loose = mode == "loose_tool_call"

    def difference(self, stored: Message, request: Message) -> RollbackReason | None:
        """None if `request` repeats `stored`, else what differs first (a rollback reason)."""
        if stored["role"] != request["role"]:
            return "role"
        if stored.get("content", "") != request.get("content", "") or stored.get("images") != request.get("images"):
            return "content"
        reasoning = request.get("reasoning_content")
        if reasoning is not None and reasoning != (stored.get("reasoning_content") or ""):
            return "reasoning_content"
        stored_calls = stored.get("tool_calls") or []
        request_calls = request.get("tool_calls") or []
        if len(stored_calls) != len(request_calls):
            return "tool_calls"
        for s, r in zip(stored_calls, request_calls, strict=True):
            if s["function"]["name"] != r["function"]["name"]:
                return "tool_calls"
            if s["id"] != r["id"]:
                return "tool_call_id"
            if not _same_arguments(s["function"]["arguments"], r["function"]["arguments"], self._loose):
                return "tool_call_arguments"
        return None

    def equal(self, stored: Message, request: Message) -> bool:
        return self.difference(stored, request) is None

    def common_prefix(self, stored: Sequence[Message], request: Any) -> tuple[int, RollbackReason | None]:
        """How many leading request messages repeat `stored`, and what differs first: `match_detail` without
        normalising the messages past the first difference or building a list, to rank several histories."""
        _check_message_list(request)
        for i, (message, raw) in enumerate(zip(stored, request, strict=False)):
            if raw is not message and raw != message \
                    and (reason := self.difference(message, normalize_message(i, raw))) is not None:
                return i, reason
        return min(len(stored), len(request)), "retry" if len(request) < len(stored) else None

    def match(self, stored: Sequence[Message], request: Any) -> tuple[list[Message], int]:
        msgs, matched, _ = self.match_detail(stored, request)
        return msgs, matched

    def match_detail(self, stored: Sequence[Message], request: Any) -> tuple[list[Message], int, RollbackReason | None]:
        """Normalise the raw request messages, count how many leading ones repeat the stored history, and say why
        the request stops repeating it before its end (None when the whole history is repeated).

        Matched messages are returned as the stored objects: they keep what was generated (reasoning,
        argument text) even when the agent echoes a lossy copy. Every request carries the whole history,
        so the common case, an exact echo of a stored message, is a single C-level dict comparison
        instead of normalise + compare: per-turn cost stays flat as the history grows.
        """
        _check_message_list(request)
        out: list[Message] = []
        matched = 0
        reason: RollbackReason | None = None
        for i, raw in enumerate(request):
            if matched == i < len(stored):
                if raw is stored[i] or raw == stored[i]:
                    out.append(stored[i])
                    matched += 1
                    continue
                message = normalize_message(i, raw)
                reason = self.difference(stored[i], message)
                if reason is None:
                    out.append(stored[i])
                    matched += 1
                    continue
                out.append(message)
            else:
                out.append(normalize_message(i, raw))
        if reason is None and matched < len(stored):
            reason = "retry"  # the request ends inside the stored history: the agent asks for a turn again
        return out, matched, reason
