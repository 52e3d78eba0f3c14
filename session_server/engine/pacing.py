"""How finely a streamed reply reaches the agent, and what that costs: the agent's chunks (their rules applied by
engine/chunker.py, the knobs `--stream-chunk-ms` and `--stream-chunk-tokens`) and the `stream_interval` a streamed
/generate asks SGLang for.

The agent's side, a contract in time: the first text goes out as soon as the first engine event brings it; after
that, what arrived goes out every CHUNK_SECONDS (counted from the last chunk), or as soon as CHUNK_TOKENS tokens are
held, whichever comes first; nothing is held past the engine's last event. So no gap between two chunks is longer
than CHUNK_SECONDS plus the time of one engine event (what is held goes out at its time; when nothing is, the next
event goes out as it comes). The events between two chunks wait in the kernel until the chunk's time (at most
200 ms and a quarter of the time the reply has streamed so far, engine/http11.py), the last one too: the end of a
streamed reply reaches the agent up to that long after the engine sent it, the price of a read per chunk rather than
per event. The token cap is twice what a GPU
decodes for one request in CHUNK_SECONDS at 5,000 tokens/s (400 tokens at 2,000): at a real engine's pace the time
decides, and the cap only cuts what arrives faster (an unpaced engine, a backlog) into chunks of CHUNK_TOKENS
tokens, several in one write.

Why time and not tokens, and why 200 ms: at a GPU's pace a streamed reply costs per chunk to the agent (a wake-up,
the read, the decode, the delta, the write: ~0.6 ms on a loaded 2-core machine), not per token. Chunks of 64 tokens
were ~260 for a 16k-token reply at 2,000 tokens/s, 4.5-6x the plain reply's server CPU; a chunk per 100 ms is ~95
(2.5-3x), per 150 ms ~66 (2.0-2.4x), per 200 ms ~51 (1.8-1.9x, within docs/design.md 7's 2x; docs/benchmarks.md,
"Streaming at a real engine's pace"). Five updates a second is a steady flow for a reader; `--stream-chunk-ms 100`
buys a smoother one for about 1.5x the streaming CPU. A slower decoder gets fewer chunks still, each no later than
the rule says.

The engine's side: SGLang sends a stream event per `stream_interval` tokens (its --stream-interval, 1 by default; a
request's `sampling_params.stream_interval` overrides it, output_streamer.py: the first token at once, then whenever
that many are unsent). What an event costs the server decides what a streamed reply costs (docs/design.md 7: at most
twice the unstreamed reply):

- delta events (`--incremental-streaming-output`) are small, but each is a JSON object of 400-700 bytes, most of it
  meta_info repeated every time: at one event per token a 32k-token reply is ~13 MB of events against the unstreamed
  reply's 1.4 MB, and reading them (the socket, the HTTP chunks, one msgspec pass over every byte) costs ~3-7x the
  unstreamed reply however they are batched (`make bench-stream`, docs/benchmarks.md). At a GPU's pace the events
  between two chunks wait in the kernel and are read at the chunk's time in one read (engine/http11.py), so an event
  costs the server little beyond its bytes: 32, 64 and 128 tokens per event measured the same within noise. One event
  per DELTA_INTERVAL tokens is therefore chosen for the time it bounds, not for its CPU: it is finer than a chunk at
  any decode speed from 160 tokens/s per request up (an event per 200 ms or sooner), and on a slower decoder the
  event, not the chunk time, is the gap (50 tokens/s: 640 ms; `--engine-stream-interval` trades the engine's work for
  time granularity there).
- cumulative events (SGLang's default) carry the whole reply so far, so n tokens at one event per token put n^2/2
  tokens on the wire (21 GB for 32k tokens, ~40 bytes each with logprobs): no reader makes that linear, and SGLang
  itself re-encodes the whole reply per event. What is linear is a bounded number of events per reply: one per
  `max_new_tokens / CUMULATIVE_EVENTS` tokens, never finer than CUMULATIVE_MIN_INTERVAL, moves about
  CUMULATIVE_EVENTS/2 replies' worth of bytes in all. So a long reply from a cumulative engine comes in about
  CUMULATIVE_EVENTS steps (the first token still at once), each read's text one chunk. docs/engines.md: run SGLang
  with --incremental-streaming-output (and the server with --engine-incremental-streaming) for a fine-grained stream.

`--engine-stream-interval N` asks for N tokens per event whatever the mode (1: every token, as SGLang's default).
"""

from __future__ import annotations

import math

CHUNK_SECONDS = 0.2  # what arrived goes out to the agent this many seconds after the last chunk (--stream-chunk-ms) ...
CHUNK_TOKENS = 2048  # ... or once this many tokens are held, whichever comes first (--stream-chunk-tokens)
DELTA_INTERVAL = 32  # tokens per delta event asked of the engine
CUMULATIVE_EVENTS = 8  # events per reply asked of a cumulative engine ...
CUMULATIVE_MIN_INTERVAL = 64  # ... but never finer than this many tokens per event
UNKNOWN_REPLY_TOKENS = 32_768  # a reply's size when neither max_new_tokens nor the engine's context is known


def stream_interval(configured: int, incremental: bool, max_new_tokens: int | None, context: int | None) -> int:
    """Tokens per engine event for one streamed request. `configured` > 0 is --engine-stream-interval; 0 chooses
    by the engine's streaming mode and the most tokens the reply can have (max_new_tokens, else the context)."""
    if configured > 0:
        return configured
    if incremental:
        return DELTA_INTERVAL
    most = max_new_tokens if max_new_tokens is not None else context or UNKNOWN_REPLY_TOKENS
    return max(CUMULATIVE_MIN_INTERVAL, math.ceil(most / CUMULATIVE_EVENTS))
