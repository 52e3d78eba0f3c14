"""The span cache (trajectory/families/span_cache.py) gives exactly the ids of tokenizing the whole text, for both
families' real tokenizers, whatever the text: long repeated spans, added-token spellings anywhere, unicode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import FAMILIES
from trajectory import ModelFamily
from trajectory.families.span_cache import MIN_SPAN_CHARS

SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])



def _spellings(family: ModelFamily) -> list[str]:
    return [t.content for t in family.tokenizer.added_tokens_decoder.values()][:64]


@pytest.mark.parametrize("name", FAMILIES)
@SETTINGS
@given(data=st.data())
def test_cached_spans_tokenize_exactly_like_the_whole_text(families, name, data):
    family = families[name]
    assert family._spans is not None
    word = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
    long_chunk = data.draw(st.lists(word, min_size=1, max_size=6)).copy()
    big = (" ".join(long_chunk) + " ") * (MIN_SPAN_CHARS // max(1, len(" ".join(long_chunk))) + 2)
    pieces = data.draw(st.lists(st.one_of(st.sampled_from(_spellings(family)), word, st.just(big)), max_size=12))
    text = "".join(pieces) + big  # long enough for the span path
    for _ in range(3):  # first sighting, second (cached now), third (from the cache)
        assert family.encode(text) == family._encode_text(text)


def test_a_repeated_tool_preamble_comes_from_the_cache(families):
    """Qwen3's preamble ends at `<|im_end|>`, an added token. (This DeepSeek tokenizer has no added token for
    `<｜User｜>`, so its preamble and the first user message are one span: nothing to reuse, still exact.)"""
    family = families["qwen3"]
    tools = [{"type": "function", "function": {"name": f"t{i}", "description": "x " * 200,
                                               "parameters": {"type": "object"}}} for i in range(6)]
    texts = [family.render([{"role": "user", "content": f"question {i}"}], tools, add_generation_prompt=True)
             for i in range(3)]
    calls: list[int] = []
    original = family._spans._encode  # type: ignore[union-attr]
    family._spans._encode = lambda t: calls.append(len(t)) or original(t)  # type: ignore[union-attr]
    try:
        for text in texts:
            assert family.encode(text) == family._encode_text(text)
    finally:
        family._spans._encode = original  # type: ignore[union-attr]
    # The third render tokenizes only its short, new tail: the preamble came from the cache.
    assert calls and max(calls[-2:]) < MIN_SPAN_CHARS, calls
