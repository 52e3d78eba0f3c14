"""The prompt lower bound is a lower bound, for both families' real tokenizers, on any text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import BOUND_FAMILIES, FAMILIES
from trajectory.bounds import min_prompt_tokens, min_tokens

TEXT = st.lists(
    st.one_of(
        st.characters(blacklist_categories=("Cs",)),  # the body reader refuses lone surrogates
        st.sampled_from([*" \t\n\r\x0b\x0c\x1c\x1d\x85\xa0\u2000\u2028\u3000ab1.!é\u0301中あ😀",
                         "'s", "<|im_end|>", "  ", "\n\n"]),
    ),
    max_size=60,
).map("".join)


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=examples(300), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_min_tokens_never_exceeds_the_real_count(families, name: str, text: str) -> None:
    family = families[name]
    assert min_tokens(text, family.max_token_chars, 10**9) <= len(family.encode(text))


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_min_prompt_tokens_never_exceeds_the_rendered_prompt(families, name: str, texts: list[str]) -> None:
    family = families[name]
    messages = []
    for i, text in enumerate(texts):
        messages.append({"role": "user", "content": text})
        if i + 1 < len(texts):
            messages.append({"role": "assistant", "content": "ok"})
    prompt = family.encode(family.render(messages, None, add_generation_prompt=True))
    assert min_prompt_tokens(messages, family.max_token_chars, 10**9) <= len(prompt)


@pytest.mark.parametrize("name", BOUND_FAMILIES)
def test_the_bound_is_tight_enough_to_refuse_a_huge_prompt(families, name: str) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 100_000  # 4.5 MB, ~1M tokens
    family = families[name]
    assert min_prompt_tokens([{"role": "user", "content": text}], family.max_token_chars, 32_768) > 32_768
    # counting stops early: the cost is bounded by the limit, not by the text
    assert min_tokens(text, 128, 10) == 11 or min_tokens(text, 128, 10) > 10


def test_malformed_messages_count_as_nothing() -> None:
    """The bound runs before validation: any shape is counted or skipped, never an exception."""
    for messages in (None, "x", [1, None, "m"], [{"role": ["user"], "content": "a b"}], [{"role": {"a": 1}}],
                     [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [1, {"text": 2}, {"text": "a b"}]}]):
        assert min_prompt_tokens(messages, 128, 100) in (0, 1)


@settings(max_examples=examples(500), deadline=None)
@given(texts=st.lists(TEXT, max_size=6), max_token_chars=st.integers(1, 8), limit=st.integers(0, 200))
def test_skipping_the_scan_of_short_texts_never_changes_the_verdict(
    texts: list[str], max_token_chars: int, limit: int
) -> None:
    """Short histories skip the per-character scan; whether a prompt is refused must not depend on that."""
    messages = [{"role": "user", "content": text} for text in texts]
    scanned = sum(min_tokens(text, max_token_chars, 10**9) for text in texts)
    assert (min_prompt_tokens(messages, max_token_chars, limit) > limit) == (scanned > limit)
