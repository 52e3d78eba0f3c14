"""engine/chunker.py: when a streamed reply's text goes out to the agent. The first text at once; then a chunk as soon
as `chunk_tokens` tokens are held, or `chunk_seconds` after the last hand-on; everything at the engine's final event;
never a chunk of more tokens than that unless one event brings them. Time is the test's own clock, never the wall's."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.engine.chunker import Chunker, Progress
from session_server.engine.reader import Added, Tokens
from support.examples import examples


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _chunker(tokens: int = 64, seconds: float = 0.1) -> tuple[Chunker, Clock]:
    clock = Clock()
    return Chunker(tokens, seconds, clock), clock


def _events(start: int, sizes: list[int], logprobs: bool = False) -> Added:
    """Delta events of `sizes` tokens after `start` tokens, each one letter per token."""
    counts = list(np.cumsum(sizes) + start)
    texts = ["x" * n for n in sizes]
    tokens = None
    if logprobs:
        ids = np.arange(start, start + sum(sizes), dtype=np.int32)
        tokens = Tokens(ids, -ids.astype(np.float32))
    return Added(texts, [int(c) for c in counts], tokens)


def _chunks(progress: Progress) -> list[int]:
    """Tokens per chunk of a Progress."""
    cuts = progress.cuts
    assert cuts is not None
    return [b - a for a, b in zip([0] + [u for _, u in cuts[:-1]], [u for _, u in cuts], strict=True)]


def test_the_first_text_goes_on_at_once() -> None:
    chunker, _ = _chunker()
    assert chunker.events_wanted(32) == 1 and chunker.due() is None
    chunker.hold(_events(0, [1]))
    first = chunker.take()
    assert first is not None and first.text == "x" and _chunks(first) == [1]


def test_held_text_goes_on_when_a_chunk_is_full() -> None:
    chunker, clock = _chunker()
    chunker.hold(_events(0, [1]))
    assert chunker.take() is not None
    assert chunker.events_wanted(32) == 2  # two events of 32 fill the next chunk: no read before then
    chunker.hold(_events(1, [32]))
    clock.now += 0.05
    assert chunker.take() is None  # 32 of 64 tokens, 50 of 100 ms
    assert chunker.events_wanted(32) == 1 and chunker.due() == 100.1
    chunker.hold(_events(33, [32]))
    full = chunker.take()
    assert full is not None and _chunks(full) == [64] and len(full.text) == 64


def test_held_text_goes_on_when_the_time_is_up() -> None:
    chunker, clock = _chunker()
    chunker.hold(_events(0, [1]))
    chunker.take()
    chunker.hold(_events(1, [10]))
    clock.now += 0.0999
    assert chunker.take() is None
    clock.now += 0.0001
    late = chunker.take()
    assert late is not None and _chunks(late) == [10]
    assert chunker.due() == clock.now + 0.1  # the next chunk's time counts from this hand-on


def test_everything_goes_on_with_the_final_event() -> None:
    chunker, _ = _chunker()
    chunker.hold(_events(0, [1]))
    chunker.take()
    chunker.hold(_events(1, [5, 5]))
    assert chunker.take() is None
    last = chunker.take(final=True)
    assert last is not None and last.text == "x" * 10 and not chunker.holding


def test_what_arrives_at_once_goes_out_in_full_chunks_in_one_hand_on() -> None:
    chunker, _ = _chunker()
    chunker.hold(_events(0, [1]))
    chunker.take()
    chunker.hold(_events(1, [16] * 9, logprobs=True))  # 144 tokens: two full chunks, 16 held
    out = chunker.take()
    assert out is not None and _chunks(out) == [64, 64] and out.tokens is not None
    assert out.tokens.ids.tolist() == list(range(1, 129))  # the tokens of the chunks, in order
    rest = chunker.take(final=True)
    assert rest is not None and rest.tokens is not None and rest.tokens.ids.tolist() == list(range(129, 145))


def test_an_event_larger_than_a_chunk_is_one_chunk() -> None:
    chunker, _ = _chunker()
    chunker.hold(_events(0, [1]))
    chunker.take()
    chunker.hold(_events(1, [100, 3]))
    out = chunker.take()
    assert out is not None and _chunks(out) == [100]


def test_cumulative_text_goes_on_as_each_read_brings_it() -> None:
    chunker, _ = _chunker()
    for text in ("a", "bc"):
        chunker.hold(Added([text], None))
        out = chunker.take()
        assert out is not None and out.text == text and out.cuts is None
        assert chunker.events_wanted(32) == 1  # every read's text is a chunk


@settings(max_examples=examples(200), deadline=None)
@given(reads=st.lists(st.tuples(st.lists(st.integers(1, 40), max_size=6), st.floats(0, 0.15)), max_size=12),
       chunk=st.integers(4, 64))
def test_no_chunk_holds_more_than_its_tokens_and_nothing_is_left_at_the_end(
        reads: list[tuple[list[int], float]], chunk: int) -> None:
    """Events of any sizes arriving at any times: every chunk holds at most `chunk` tokens unless one event brings
    more; what is held after a hand-on is less than a chunk, and held no longer than the time rule allows; at the
    end nothing is held, and the text went on whole and in order."""
    chunker, clock = _chunker(chunk, 0.1)
    tokens = 0
    sent: list[tuple[int, str]] = []
    for sizes, elapsed in reads:
        clock.now += elapsed
        if sizes:
            chunker.hold(_events(tokens, sizes))
            tokens += sum(sizes)
        out = chunker.take()
        if out is not None:
            assert all(n <= chunk or n in sizes for n in _chunks(out))
            sent.append((sum(_chunks(out)), out.text))
        held = tokens - chunker.handed
        assert held < chunk  # a full chunk never waits
        assert not held or (chunker.texted and chunker.due() is not None and clock.now < chunker.due())
    last = chunker.take(final=True)
    if last is not None:
        sent.append((sum(_chunks(last)), last.text))
    assert not chunker.holding
    assert sum(n for n, _ in sent) == tokens and "".join(t for _, t in sent) == "x" * tokens
