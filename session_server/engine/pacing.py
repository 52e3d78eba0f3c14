"""How many tokens one engine stream event carries: the `stream_interval` a streamed /generate asks SGLang for.

SGLang sends a stream event per `stream_interval` tokens (its --stream-interval, 1 by default; a request's
`sampling_params.stream_interval` overrides it, output_streamer.py: the first token at once, then whenever that many
are unsent). What an event costs the server decides what a streamed reply costs (docs/design.md 7: at most twice the
unstreamed reply):

- delta events (`--incremental-streaming-output`) are small, but each is a JSON object of 400-700 bytes, most of it
  meta_info repeated every time: its decode alone costs 3-10x what an unstreamed reply costs per token (measured by
  `make bench-stream`). One event per DELTA_INTERVAL tokens keeps a streamed reply under twice the unstreamed one
  with room for a loaded machine (measured at 16k/32k tokens, load ~7: 2.14/2.15x at 16 tokens per event, 1.47/1.69x
  at 32); at a decode speed of 100-400 tokens/s per request that is an event every 80-320 ms, which an agent that acts
  on the whole reply does not notice.
- cumulative events (SGLang's default) carry the whole reply so far, so n tokens at one event per token put n^2/2
  tokens on the wire (21 GB for 32k tokens, ~40 bytes each with logprobs): no reader makes that linear, and SGLang
  itself re-encodes the whole reply per event. What is linear is a bounded number of events per reply: one per
  `max_new_tokens / CUMULATIVE_EVENTS` tokens moves about CUMULATIVE_EVENTS/2 replies' worth of bytes in all. The
  agent then gets its text in that many steps (the first token still at once): run SGLang with
  --incremental-streaming-output (and the server with --engine-incremental-streaming) for a fine-grained stream.

`--engine-stream-interval N` asks for N tokens per event whatever the mode (1: every token, as SGLang's default).
"""

from __future__ import annotations

import math

DELTA_INTERVAL = 32
CUMULATIVE_EVENTS = 8
UNKNOWN_REPLY_TOKENS = 32_768  # a reply's size when neither max_new_tokens nor the engine's context is known


def stream_interval(configured: int, incremental: bool, max_new_tokens: int | None, context: int | None) -> int:
    """Tokens per engine event for one streamed request. `configured` > 0 is --engine-stream-interval; 0 chooses
    by the engine's streaming mode and the most tokens the reply can have (max_new_tokens, else the context)."""
    if configured > 0:
        return configured
    if incremental:
        return DELTA_INTERVAL
    most = max_new_tokens if max_new_tokens is not None else context or UNKNOWN_REPLY_TOKENS
    return max(DELTA_INTERVAL, math.ceil(most / CUMULATIVE_EVENTS))
