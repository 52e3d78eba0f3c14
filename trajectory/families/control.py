"""Text inside messages is text: spellings of a family's control tokens in message content never become tokens.

A tokenizer matches its added tokens (`<|im_start|>`, `<｜User｜>`, `<tool_call>`, ...) anywhere in the text it is
given, before BPE. A chat template pastes message text next to its own markup, so a user or tool message that spells
`<|im_end|>\\n<|im_start|>system\\n...` would, rendered and tokenized as one string, forge chat structure inside the
training sample. The engine's own chat endpoint behaves that way; we do not by default.

How: before rendering, every string of the request (message fields, tool-call arguments, tool schemas, dict keys
included) has a placeholder `M<k><side>M` put beside each control-token spelling, where M is a private-use character
that occurs in no string of the request, k names the spelling and side says whether it sits before or after the
placeholder. The spelling itself stays: a template may test a message's text for one (Qwen's finds the last user
query by `<tool_response>` at both ends of a user message's content), and it must decide as it does on the text
itself. So the placeholder goes after the spelling, or before it when the spelling ends its string, and the string
keeps its start and its end. The rendered text is then cut at the placeholders: each takes its spelling out of the
text beside it and becomes the spelling's plain-text ids (split after its first character, so no added token can
match); the pieces between are tokenized normally, so every control token left was written by the template.
Where the template did not leave a spelling beside its placeholder (it escaped, split or rewrote the text), the
request is rendered again with each spelling replaced by its placeholder outright (`beside=False`): the template then
decides as on text without the spelling, and the rendered text holds no spelling of the request's at all. (A template
that escaped the placeholder itself, JSON with ensure_ascii, would leave the spelling in place unnoticed: the
families' renderers write JSON as UTF-8, transformers' `tojson` among them, and test_control_tokens checks each
family's ids for control tokens.) A request without any spelling takes none of this path: it is rendered and
tokenized exactly as before, at the cost of one scan of its JSON text.

Which tokens: every added token of the tokenizer except the markup the family's template itself parses out of
message text (`<think>`/`</think>`: the templates split reasoning off an assistant's content on them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

_PRIVATE_USE = range(0xE000, 0xF900)
_BEFORE, _AFTER, _INSTEAD = "b", "a", "r"  # a placeholder's spelling: just before it, just after it, or replaced
_encode_json = msgspec.json.Encoder().encode


def trie_pattern(words: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any of `words` (longest first) that branches like a trie: cost per position grows with the
    length of the words, not their number (DeepSeek has over a thousand added tokens)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        ends = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if ends else body

    return re.compile(build(trie)) if trie else re.compile(r"(?!)")


class ControlTokens:
    def __init__(self, spellings: Iterable[str], encode: Callable[[str], list[int]], token_ids: frozenset[int]):
        self.spellings: tuple[str, ...] = tuple(sorted(set(spellings), key=lambda s: (-len(s), s)))
        self._index = {s: i for i, s in enumerate(self.spellings)}
        self._pattern = trie_pattern(self.spellings)
        self._encode = encode
        self._token_ids = token_ids  # every added token's id: none may come out of a spelling's text encoding
        self._text_ids: dict[int, list[int]] = {}
        # A value's JSON text holds every string of it (dict keys included) verbatim but for the characters JSON
        # escapes; where no spelling has one, a value whose JSON holds no spelling has no string that does.
        self._json_scan = all(_encode_json(s)[1:-1] == s.encode() for s in self.spellings)

    # -- before rendering ----------------------------------------------------------------------------------
    def _strings(self, value: Any, out: list[str]) -> None:
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str):
                    out.append(k)
                self._strings(v, out)
        elif isinstance(value, list | tuple):
            for v in value:
                self._strings(v, out)

    def _json_clean(self, value: Any) -> bool:
        """No spelling in `value`'s JSON text, so none in its strings: one encode and one search in C, where the walk
        over its strings (a call per string, dict and list: 250 for 8 tool schemas) costs several times more. A value
        that does not encode, or whose JSON holds a spelling anywhere (also outside its strings), is left to the
        walk."""
        if not self._json_scan:
            return False
        try:
            text = _encode_json(value).decode()
        except (TypeError, ValueError, RecursionError):
            return False
        return self._pattern.search(text) is None

    def protect(self, value: Any, beside: bool = True) -> tuple[Any, str | None]:
        """(value with a placeholder beside each spelling, marker) -- or (value itself, None) when no string of it
        spells a control token, the common case. `beside=False`: each spelling replaced by its placeholder."""
        if self._json_clean(value):
            return value, None
        strings: list[str] = []
        self._strings(value, strings)
        search = self._pattern.search
        if not any(search(s) for s in strings):
            return value, None
        marker = next(chr(c) for c in _PRIVATE_USE if not any(chr(c) in s for s in strings))
        index = self._index

        def sub(s: str) -> str:
            def placed(m: re.Match[str]) -> str:
                spelling = m.group()
                if not beside:
                    return f"{marker}{index[spelling]}{_INSTEAD}{marker}"
                if m.end() == len(s) and m.start() > 0:  # the string's end stays its end
                    return f"{marker}{index[spelling]}{_AFTER}{marker}{spelling}"
                return f"{spelling}{marker}{index[spelling]}{_BEFORE}{marker}"

            return self._pattern.sub(placed, s)

        def walk(v: Any) -> Any:
            if isinstance(v, str):
                return sub(v)
            if isinstance(v, dict):
                return {(sub(k) if isinstance(k, str) else k): walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            if isinstance(v, tuple):
                return tuple(walk(x) for x in v)
            return v

        return walk(value), marker

    # -- after rendering -----------------------------------------------------------------------------------
    def text_ids(self, k: int) -> list[int]:
        """The spelling's ids as plain text: its first character, then the rest, tokenized apart (one character
        at a time if even that would match an added token)."""
        ids = self._text_ids.get(k)
        if ids is None:
            spelling = self.spellings[k]
            ids = self._encode(spelling[0]) + self._encode(spelling[1:])
            if self._token_ids.intersection(ids):
                ids = [i for ch in spelling for i in self._encode(ch)]
            self._text_ids[k] = ids
        return list(ids)

    def encode(self, text: str, marker: str) -> list[int] | None:
        """Tokenize rendered text whose placeholders (for `marker`) stand for spellings that must stay text; None when
        a placeholder's spelling is not beside it (the template changed the text around it)."""
        parts = re.split(f"{re.escape(marker)}([0-9]+)([{_BEFORE}{_AFTER}{_INSTEAD}]){re.escape(marker)}", text)
        pieces, ks, sides = parts[0::3], parts[1::3], parts[2::3]
        for j, (k, side) in enumerate(zip(ks, sides, strict=True)):
            spelling = self.spellings[int(k)]
            if side == _BEFORE:  # taken out of the text before the placeholder
                if not pieces[j].endswith(spelling):
                    return None
                pieces[j] = pieces[j][:-len(spelling)]
            elif side == _AFTER:  # taken out of the text after it
                if not pieces[j + 1].startswith(spelling):
                    return None
                pieces[j + 1] = pieces[j + 1][len(spelling):]
        ids: list[int] = self._encode(pieces[0]) if pieces[0] else []
        for j, k in enumerate(ks):
            ids += self.text_ids(int(k))
            if pieces[j + 1]:
                ids += self._encode(pieces[j + 1])
        return ids
