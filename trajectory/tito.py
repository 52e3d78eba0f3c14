"""Token-in-token-out prompt building (docs/design.md section 4).

A first turn renders the whole conversation with the family's template and tokenizes it. Every later
turn reuses the stored token ids verbatim (what the model actually saw and sampled) and tokenizes only
the text of the appended messages, so the cost of a turn grows with what is new, never with the history.
Tokenizing the appended text on its own is exact because it always starts at a special token or right
after one, and special tokens split BPE: no merge can cross the boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .families.base import ModelFamily
from .first_turns import refuse_render
from .images import has_images, spelled

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


def _render_ids(family: ModelFamily, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                text_only: bool, render: Render) -> np.ndarray:
    """`render(messages, tools)` tokenized as int32 ids; with `text_only`, control-token spellings inside the messages
    and tools stay text (families/control.py): protected before rendering, restored as text ids after."""
    def rendered(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        if family.vision is not None and has_images(messages):  # after protecting: the marker blocks are the template's
            messages = spelled(messages)
        return render(list(messages), tools)

    marker = None
    if text_only:
        (beside, beside_tools), marker = family.control.protect((list(messages), tools))
    if marker is None:  # tokenized as one string: the engine's way, or no spelling to keep as text
        return np.asarray(family.encode(rendered(messages, tools)), dtype=np.int32)
    ids = family.control.encode(rendered(beside, beside_tools), marker)
    if ids is None:  # the template changed a string around a spelling: rendered again with the spellings replaced
        (instead, instead_tools), marker = family.control.protect((list(messages), tools), beside=False)
        assert marker is not None  # the same request, so the same spellings to replace
        ids = family.control.encode(rendered(instead, instead_tools), marker)
        assert ids is not None  # a placeholder alone always stands for its spelling
    return np.asarray(ids, dtype=np.int32)


def first_turn_ids(family: ModelFamily, messages: Sequence[dict[str, Any]],
                   tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None = None,
                   text_only: bool = True) -> np.ndarray:
    """The whole conversation rendered with the generation prompt, as int32 ids (read-only when they came from or
    went into the family's first-turn cache).

    `text_only`: spellings of control tokens inside the messages and tools are tokenized as text (families/control.py);
    False tokenizes the rendered string as one, as the engine's own chat endpoint does.
    """
    def render() -> np.ndarray:
        return _render_ids(family, messages, tools, text_only, lambda m, t: family.render(
            m, t, add_generation_prompt=True, template_kwargs=template_kwargs))

    cache = family.first_turns  # a GRPO group's samples open with the same request (first_turns.py)
    key = cache.key(messages, tools, template_kwargs, text_only)
    if key is None:
        refuse_render()  # nothing kept to answer from: inside cached_only(), NotCached
        return render()
    return cache.ids(key, render)


def continuation_ids(family: ModelFamily, last_completion_token: int | None,
                     appended: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any] | None = None, text_only: bool = True,
                     last_message: dict[str, Any] | None = None) -> tuple[int, np.ndarray]:
    """(trim, ids): drop `trim` stored tail tokens, then append `ids`, to continue after a generated turn.

    `last_completion_token` is the last token the previous turn generated (None if it generated nothing).
    Ending on the template's own stop token means the message is closed; ending on another stop token
    (Qwen3's `<|endoftext|>`) means that token is replaced by the template's; anything else (length,
    abort) leaves the message open and what the template writes after `last_message` (the reply parsed from it: a
    harmony call ends with `<|call|>`) is appended after it. `text_only` as in `first_turn_ids`.
    """
    closed = family.closes_message(last_completion_token)
    trim = family.trimmed_tokens(last_completion_token)
    end = None if closed or trim else family.open_message_end(last_message or {})
    if family.tools_only_in_preamble:  # not rendered after the preamble: not scanned for control spellings either
        tools = None
    return trim, _render_ids(family, appended, tools, text_only, lambda m, t: family.appended_text(
        m, t, closed=closed, template_kwargs=template_kwargs, end=end))
