"""How finely a streamed reply reaches the agent, and what that costs: the `stream_interval` a streamed /generate asks
SGLang for, and the agent's chunks (their rules applied by engine/chunker.py).

The agent's side: it gets new text at least every CHUNK_TOKENS tokens or CHUNK_SECONDS, whichever comes first --
the first text at once, nothing held back past the engine's last event, and what arrives faster than that coalesced
into chunks of CHUNK_TOKENS tokens (several chunks go out in one write). That needs engine events at least that fine.

The engine's side: SGLang sends a stream event per `stream_interval` tokens (its --stream-interval, 1 by default; a
request's `sampling_params.stream_interval` overrides it, output_streamer.py: the first token at once, then whenever
that many are unsent). What an event costs the server decides what a streamed reply costs (docs/design.md 7: at most
twice the unstreamed reply):

- delta events (`--incremental-streaming-output`) are small, but each is a JSON object of 400-700 bytes, most of it
  meta_info repeated every time: at one event per token a 32k-token reply is ~13 MB of events against the unstreamed
  reply's 1.4 MB, and reading them (the socket, the HTTP chunks, one msgspec pass over every byte) costs ~3-7x the
  unstreamed reply however they are batched (`make bench-stream`, docs/benchmarks.md). An engine that decodes at a
  GPU's pace costs per event read instead (a wake-up, a read, a decode: measured ~0.6 ms each on a loaded machine;
  since the stream loop wakes once per agent chunk rather than per event, engine/sse.py, mostly per chunk), so
  halving the interval raises that cost: a paced 2k-token reply cost 2.1x unstreamed at 32 tokens per event and
  4x at 16. One event per DELTA_INTERVAL tokens keeps a streamed reply near twice the unstreamed one and still finer
  than the agent's chunks; at a decode speed of 320 tokens/s per request or more it is also an event per 100 ms
  (`--engine-stream-interval` trades CPU for time granularity on slower decoders).
- cumulative events (SGLang's default) carry the whole reply so far, so n tokens at one event per token put n^2/2
  tokens on the wire (21 GB for 32k tokens, ~40 bytes each with logprobs): no reader makes that linear, and SGLang
  itself re-encodes the whole reply per event. What is linear is a bounded number of events per reply: one per
  `max_new_tokens / CUMULATIVE_EVENTS` tokens, never finer than CHUNK_TOKENS, moves about CUMULATIVE_EVENTS/2
  replies' worth of bytes in all. So a cumulative engine gives the agent chunks of CHUNK_TOKENS tokens only for
  replies of up to CHUNK_TOKENS * CUMULATIVE_EVENTS tokens; a longer one comes in CUMULATIVE_EVENTS steps (the
  first token still at once). docs/engines.md: run SGLang with --incremental-streaming-output (and the server with
  --engine-incremental-streaming) for a fine-grained stream.

`--engine-stream-interval N` asks for N tokens per event whatever the mode (1: every token, as SGLang's default).
"""

from __future__ import annotations

import math

CHUNK_TOKENS = 64  # the agent gets new text at least every this many tokens (where the engine's events allow) ...
CHUNK_SECONDS = 0.1  # ... or this many seconds after the last chunk, whichever comes first
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
    return max(CHUNK_TOKENS, math.ceil(most / CUMULATIVE_EVENTS))
