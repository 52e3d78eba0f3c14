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


def first_turn_ids(family: ModelFamily, messages: Sequence[dict[str, Any]],
                   tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None = None) -> np.ndarray:
    """The whole conversation rendered with the generation prompt, as int32 ids."""
    text = family.render(messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
    return np.asarray(family.encode(text), dtype=np.int32)


def continuation_ids(family: ModelFamily, last_completion_token: int | None,
                     appended: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     template_kwargs: dict[str, Any] | None = None) -> tuple[int, np.ndarray]:
    """(trim, ids): drop `trim` stored tail tokens, then append `ids`, to continue after a generated turn.

    `last_completion_token` is the last token the previous turn generated (None if it generated nothing).
    Ending on the template's own stop token means the message is closed; ending on another stop token
    (Qwen3's `<|endoftext|>`) means that token is replaced by the template's; anything else (length,
    abort) leaves the message open and the template's stop token is appended after it.
    """
    closed = last_completion_token == family.eos_token_id
    trim = int(not closed and last_completion_token in family.stop_token_ids)
    text = family.appended_text(appended, tools, closed=closed, template_kwargs=template_kwargs)
    return trim, np.asarray(family.encode(text), dtype=np.int32)
