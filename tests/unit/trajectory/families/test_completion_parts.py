"""The steps several families take alike (trajectory/families/completion_parts.py): a `<think>` block written by
`join_think` reads back by `split_think`, tight or padded, and `cut_calls` cuts out exactly the spans it is given
calls for, leaving a refused span and everything around it verbatim."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from trajectory.families.base import ToolCall
from trajectory.families.completion_parts import cut_calls, join_think, split_think

OPEN, CLOSE = "<think>", "</think>"
_TEXT = st.text(st.sampled_from("ab \n<>/{}"), max_size=12).filter(lambda t: CLOSE not in t)


@given(reasoning=st.none() | _TEXT, content=st.text(st.sampled_from("ab \n<"), max_size=12), padded=st.booleans())
def test_a_written_think_block_reads_back(reasoning: str | None, content: str, padded: bool) -> None:
    """Content spelled from letters that cannot open a block; reasoning with newlines at either end, which the
    padding must not eat."""
    text = join_think(reasoning, OPEN, CLOSE, padded=padded) + content
    assert split_think(text, OPEN, CLOSE, padded=padded) == (reasoning, content)


def test_an_unterminated_block_is_all_reasoning() -> None:
    assert split_think("<think>\nhalf a thou", OPEN, CLOSE, padded=True) == ("half a thou", "")
    assert split_think("<think>\nhalf a thou", OPEN, CLOSE, padded=False) == ("\nhalf a thou", "")
    assert split_think("no block <think>x</think>", OPEN, CLOSE, padded=True) == (None, "no block <think>x</think>")


_SPAN = re.compile(r"\[(.*?)\]")


def _read(match: re.Match[str]) -> tuple[list[ToolCall], str] | None:
    """`[name]` is a call, `[name|stray]` a call with text that stays, `[]` malformed."""
    name, _, stray = match.group(1).partition("|")
    return ([ToolCall(name=name, arguments="{}")], stray) if name else None


def test_cut_calls_takes_what_it_is_given_calls_for_and_leaves_the_rest() -> None:
    content, calls = cut_calls("a\n[f] b [] c\n[g|x]d", _SPAN, _read)
    assert content == "a\n b [] c\nxd"
    assert [c.name for c in calls] == ["f", "g"]
    content, calls = cut_calls("a\n[f] b [] c\n[g|x]d", _SPAN, _read, separator="\n")
    assert content == "a b [] cxd"  # the separator goes with a taken span only
    assert cut_calls("no spans [] here", _SPAN, _read) == ("no spans [] here", [])
