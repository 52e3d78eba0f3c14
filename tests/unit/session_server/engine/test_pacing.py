"""engine/pacing.py: the stream interval asked of the engine, by its streaming mode and the reply's size."""

from __future__ import annotations

from session_server.engine import pacing


def test_stream_interval_by_mode_and_reply_size() -> None:
    assert pacing.stream_interval(3, True, 100, None) == 3  # the flag wins in both modes
    assert pacing.stream_interval(1, False, 32_768, None) == 1
    assert pacing.stream_interval(0, True, 32_768, None) == pacing.DELTA_INTERVAL
    events = pacing.CUMULATIVE_EVENTS
    assert pacing.stream_interval(0, False, 32_768, None) == -(-32_768 // events)
    assert pacing.stream_interval(0, False, None, 65_536) == -(-65_536 // events)  # no max_tokens: the context
    assert pacing.stream_interval(0, False, None, None) == -(-pacing.UNKNOWN_REPLY_TOKENS // events)
    assert pacing.stream_interval(0, False, 10, None) == pacing.CUMULATIVE_MIN_INTERVAL == 64  # never finer


def test_the_chunk_rule_is_by_time_at_a_gpus_pace() -> None:
    """A GPU decoding 2,000-5,000 tokens/s for one request: a delta event comes within a chunk's time (the events
    are finer than the chunks), and the token cap is above what it decodes in that time (the time decides)."""
    assert pacing.DELTA_INTERVAL / 2_000 <= pacing.CHUNK_SECONDS
    assert 5_000 * pacing.CHUNK_SECONDS < pacing.CHUNK_TOKENS
