"""A cheap lower bound on how many tokens a request's prompt has, to refuse hopeless prompts before rendering.

Rendering and tokenizing a multi-megabyte prompt costs seconds of CPU, only for the engine to refuse it as longer
than its context. The bound is computed from the message text alone, in time proportional to the bound (it stops
counting once past the limit), and is never above the real count, so a prompt it refuses could never have fit:

- length: no token spans more than `max_token_chars` characters (the longest vocabulary entry, in bytes);
- words: both families' pre-tokenizers (GPT-style byte-level regex splits) start a new pre-token at every non-space
  character that follows a space character (whitespace only ever leads a pre-token, as a single optional character,
  or forms whitespace-only pre-tokens), and every pre-token is at least one token.

Only text a template always renders verbatim is counted: user, system and tool message content (an assistant's
content may be cut by the template, e.g. Qwen3 drops earlier reasoning). tests/unit/trajectory/test_bounds.py checks
the bound
against the real tokenizers with hypothesis.
"""

from __future__ import annotations

import re
from typing import Any

# Unicode White_Space, as the tokenizers' regex `\s` means it (Python's `\s` adds \x1c-\x1f, which are not spaces).
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WORD_START = re.compile(f"[{_WS}](?=[^{_WS}])")
_VERBATIM_ROLES = frozenset({"user", "system", "developer", "tool"})


def min_tokens(text: str, max_token_chars: int, stop_above: int) -> int:
    """A lower bound on the tokens of `text`; counting stops once it exceeds `stop_above`."""
    by_length = -(-len(text) // max_token_chars)
    if by_length > stop_above:
        return by_length
    words = 0
    for words, _ in enumerate(_WORD_START.finditer(text), 1):
        if words > stop_above:
            break
    return max(by_length, words)


def _verbatim_texts(messages: Any) -> list[str]:
    texts: list[str] = []
    if not isinstance(messages, list):
        return texts
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _VERBATIM_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return texts


def min_prompt_tokens(messages: Any, max_token_chars: int, stop_above: int) -> int:
    """A lower bound on the prompt tokens of a request with these (raw, unvalidated) messages; counting stops once
    it exceeds `stop_above`. Malformed messages count as nothing (validation refuses them later)."""
    texts = _verbatim_texts(messages)
    # Neither count of a text exceeds (len + 1) // 2: word starts are a space followed by a non-space, so no two are
    # adjacent, and the length bound is at most that when max_token_chars >= 2. Texts that are short in total cannot
    # pass the limit, so the per-character scan -- the one step of a turn whose cost grows with the history an agent
    # resends -- is skipped and the length bound alone (still a lower bound) is returned.
    if max_token_chars >= 2 and sum((len(t) + 1) // 2 for t in texts) <= stop_above:
        return sum(-(-len(t) // max_token_chars) for t in texts)
    total = 0
    for text in texts:
        total += min_tokens(text, max_token_chars, stop_above - total)
        if total > stop_above:
            break
    return total
