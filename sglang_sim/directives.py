"""The `[[sim: ...]]` directive syntax, in one place: how a prompt scripts the emulated engine's reply.

A message may carry any of `[[sim: think]]` (a reasoning block), `[[sim: reply TEXT]]` (a fixed answer),
`[[sim: tokens N]]` (N tokens of seeded words) and `[[sim: tool_call name=NAME args=JSON]]` (repeat it for parallel
calls). The builders here are what the rollout scripts, the soak and the benchmarks use to write them; `read` is how
the engine reads one message's (generation.find_script picks the message: the last one that has any).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MARK = "[[sim:"
PATTERN = re.compile(r"\[\[sim:\s*(tool_call|think|reply|tokens)\b")
THINK = "[[sim: think]]"
_JSON_OPENERS = re.compile(r'["{\[]')


def tool_call(name: str, **args: Any) -> str:
    return f"[[sim: tool_call name={name} args={json.dumps(args)}]]"


def reply(text: str) -> str:
    return f"[[sim: reply {text}]]"


def tokens(n: int) -> str:
    return f"[[sim: tokens {n}]]"


@dataclass(frozen=True)
class Script:
    """What the prompt asked for; empty fields fall back to seeded words."""

    think: bool = False
    reply: str | None = None
    tokens: int | None = None
    tool_calls: tuple[tuple[str, str], ...] = ()


def read(text: str) -> Script:
    """The directives of one message's text, as the agent wrote them: unescaped first when a template wrote the
    message as a JSON string (`tojson`, as Llama 3.1 writes tool results)."""
    return parse_script(quoted_directives(text) or text)


def parse_script(text: str) -> Script:
    """Read every directive of one message; `tool_call` repeats into parallel calls."""
    think = False
    reply: str | None = None
    tokens: int | None = None
    calls: list[tuple[str, str]] = []
    decoder = json.JSONDecoder()
    for m in PATTERN.finditer(text):
        kind, rest = m.group(1), text[m.end():]
        if kind == "think":
            think = True
        elif kind == "tokens":
            num = re.match(r"\s*(\d+)\s*\]\]", rest)
            if num:
                tokens = int(num.group(1))
        elif kind == "reply":
            end = rest.find("]]")
            if end >= 0:
                reply = rest[:end].strip()
        else:
            call = re.match(r"\s*name=([A-Za-z0-9_.\-]+)\s+args=", rest)
            if not call:
                continue
            try:
                args, _ = decoder.raw_decode(rest[call.end():])
            except json.JSONDecodeError:
                continue
            calls.append((call.group(1), json.dumps(args, ensure_ascii=False)))
    return Script(think=think, reply=reply, tokens=tokens, tool_calls=tuple(calls))


def quoted_directives(text: str) -> str | None:
    """The string inside a JSON value that holds the directives, unescaped; None when no JSON value before the first
    directive holds one (the directives are written plainly).

    The text is read left to right as JSON where it can be: a value that decodes is skipped whole, so a quote inside
    it (the closing quote of a key in a tool result's `{"temperature": 25}`) never starts a string of its own."""
    first = text.find(MARK)
    if first < 0:
        return None
    decoder = json.JSONDecoder()
    pos = 0
    while (opener := _JSON_OPENERS.search(text, pos, first)) is not None:
        try:
            value, end = decoder.raw_decode(text, opener.start())
        except ValueError:
            pos = opener.start() + 1
            continue
        held = next((s for s in _strings(value) if MARK in s), None)
        if held is not None:
            return held
        pos = end
    return None


def _strings(value: Any) -> Iterator[str]:
    """Every string in a decoded JSON value, keys included, depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
