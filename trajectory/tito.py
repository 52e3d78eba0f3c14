"""Token-in-token-out prompt building (DESIGN.md section 4).

A first turn renders the whole conversation with the family's template and tokenizes it. Every later
turn reuses the stored token ids verbatim (what the model actually saw and sampled) and tokenizes only
the text of the appended messages, so the cost of a turn grows with what is new, never with the history.
Tokenizing the appended text on its own is exact because it always starts at a special token or right
after one, and special tokens split BPE: no merge can cross the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .families.base import ModelFamily


def _encode(family: ModelFamily, text: str, marker: str | None) -> np.ndarray:
    ids = family.encode(text) if marker is None else family.control.encode(text, marker)
    return np.asarray(ids, dtype=np.int32)


def first_turn_ids(family: ModelFamily, messages: Sequence[dict[str, Any]],
                   tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None = None,
                   text_only: bool = True) -> np.ndarray:
    """The whole conversation rendered with the generation prompt, as int32 ids.

    `text_only`: spellings of control tokens inside the messages and tools are tokenized as text (families/control.py);
    False tokenizes the rendered string as one, as the engine's own chat endpoint does.
    """
    marker = None
    if text_only:
        (messages, tools), marker = family.control.protect((list(messages), tools))
    text = family.render(messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
    return _encode(family, text, marker)


def continuation_ids(family: ModelFamily, last_completion_token: int | None,
                     appended: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any] | None = None, text_only: bool = True) -> tuple[int, np.ndarray]:
    """(trim, ids): drop `trim` stored tail tokens, then append `ids`, to continue after a generated turn.

    `last_completion_token` is the last token the previous turn generated (None if it generated nothing).
    Ending on the template's own stop token means the message is closed; ending on another stop token
    (Qwen3's `<|endoftext|>`) means that token is replaced by the template's; anything else (length,
    abort) leaves the message open and the template's stop token is appended after it. `text_only` as in
    `first_turn_ids`.
    """
    closed = last_completion_token == family.eos_token_id
    trim = int(not closed and last_completion_token in family.stop_token_ids)
    marker = None
    if text_only:
        (appended, tools), marker = family.control.protect((list(appended), tools))
    text = family.appended_text(appended, tools, closed=closed, template_kwargs=template_kwargs)
    return trim, _encode(family, text, marker)
