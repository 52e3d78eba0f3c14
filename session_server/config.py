"""Server configuration: one frozen dataclass built from the CLI flags.

Every behaviour switch is read from here at the place it matters, so a flag never changes behaviour far from where it
is documented (docs/design.md 8).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

from session_server.cpu_pool import DEFAULT_INLINE_BELOW_BYTES
from session_server.engine.client import ENGINE_CLIENTS
from session_server.engine.pacing import CHUNK_SECONDS, CHUNK_TOKENS
from session_server.sessions.journal import SYNC_MODES
from trajectory import first_turns
from trajectory.images import ImageLimits
from trajectory.linear import SPECIAL_TOKEN_MODES
from trajectory.messages import MATCHER_NAMES as MATCHERS
from trajectory.session_segments import DIVERGENCE_POLICIES

# A replica's name starts the ids it mints (`NAME.<hex>`), which a load balancer maps back to it: lowercase, short,
# and with no dot, so the name is exactly what precedes an id's first dot.
REPLICA_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
# POST /sessions/{id}/prime: "engine" has the engine prefill the primed prompt before the prime answers
# (turns/prefill.py), "off" leaves it to the group's first turns.
FORK_PREFILL_MODES = ("engine", "off")


def default_cpu_workers() -> int:
    """min(16, cores): enough threads to keep decode off the loop without oversubscribing small machines."""
    return max(1, min(16, os.cpu_count() or 1))


STRADDLED_REPLIES = ("recompute", "keep")
STALE_TURNS = ("regenerate", "refuse")
ADAPTER_REVISIONS = ("pinned", "latest")  # --adapter-revisions (engine/adapters.py)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine_url: str
    tokenizer: str
    model_family: str
    host: str = "127.0.0.1"
    port: int = 8000
    cpu_workers: int = dataclasses.field(default_factory=default_cpu_workers)
    max_rollback: int = 1
    # A request that extends no segment within max_rollback: "segment" starts a new one, "reject" is a 400.
    on_divergence: str = "segment"
    max_segments: int = 16  # segments per session (trajectory/session_segments.py); a request past it gets 400
    # A full render that extends a segment's every token continues that segment (LinearTrajectory.merge_plan).
    merge_segments: bool = False
    engine_sessions: bool = False
    request_timeout: float = 600.0
    # Times one turn is continued after the engine aborted every in-flight request (turns/resume.py); 0: never.
    max_turn_continuations: int = 4
    # A reply running when new weights are pushed (issue 38): "recompute" cuts it at the pause and continues it under
    # the new weights and their cache key (exact); "keep" lets it run on in place (its later tokens are sampled by the
    # new weights on KV of the old, marked by the sample's weight-version spans).
    straddled_replies: str = "recompute"
    # Versions a turn may fall behind at a push before it is sampled again from its prompt (-1: no bound); what then
    # happens to it: "regenerate" (the agent sees one reply, later) or "refuse" (a 503 to retry).
    max_staleness: int = -1
    stale_turns: str = "regenerate"
    # LoRA (issue 40, engine/adapters.py): the adapter of sessions that name none (None: the base model), and whether a
    # session keeps the adapter revision it was pinned to ("pinned") or takes the newest at each turn ("latest").
    lora_adapter: str | None = None
    adapter_revisions: str = "pinned"
    keep_adapter_revisions: bool = False  # never unload a superseded revision (several servers share one engine)
    max_request_bytes: int = 16 * 1024 * 1024
    max_metadata_bytes: int = 64 * 1024  # POST /sessions metadata, encoded (413 beyond)
    body_timeout: float = 30.0  # seconds for a request body to arrive in full (408 after)
    max_header_bytes: int = 64 * 1024  # request line + headers of one request (431 beyond)
    max_sessions: int = 0  # live sessions; POST /sessions beyond gets 503 + Retry-After; 0 = unbounded
    max_fork: int = 64  # children one POST /sessions/{id}/fork may create (400 beyond)
    fork_prefill: str = "engine"  # FORK_PREFILL_MODES
    max_session_tokens: int = 0  # tokens one session may hold (prompt + completion); 0 = unbounded
    drain_timeout: float = 60.0  # /admin/pause drain: seconds to wait for chats before aborting them (503)
    shutdown_timeout: float = 5.0  # SIGTERM: seconds uvicorn waits for open connections before closing them
    message_matcher: str = "loose_tool_call"
    special_tokens_in_content: str = "text"  # "engine": control-token spellings in message text become the tokens
    admin_token: str | None = None
    otlp_endpoint: str | None = None  # OpenTelemetry: turn and admin spans to this OTLP/HTTP collector (tracing.py)
    inline_decode: bool = False
    inline_below_bytes: int = DEFAULT_INLINE_BELOW_BYTES
    first_turn_cache_tokens: int = first_turns.DEFAULT_MAX_TOKENS  # trajectory/first_turns.py; 0 keeps none
    return_routed_experts: bool = False
    # Sampling masks (turns/sampling_masks.py): every session asks the engine for the kept ids of each sampled token
    # (a session may say otherwise at POST /sessions); a request without a top-k bound gets `sampling_mask_top_k`
    # (0: it is refused), and no top_k above `sampling_mask_max_tokens` (the engine's --sampling-mask-max-tokens).
    return_sampling_masks: bool = False
    sampling_mask_top_k: int = 0
    sampling_mask_max_tokens: int = 4096
    # Every Chat and Responses reply carries the turn's token ids (frontend/token_ids.py), as if the request had asked
    # with `return_token_ids: true`; a request's own `return_token_ids: false` still turns them off.
    return_token_ids: bool = False
    engine_connections: int = 512
    engine_client: str = "httptools"  # the /generate hot path: engine/http11.py, or "httpx" to measure against it
    retry_after: int = 1
    abort_grace: float = 5.0
    tombstones: int = 100_000  # ids of deleted sessions remembered, oldest forgotten first (about 200 bytes each)
    session_idle_timeout: float = 3600.0  # seconds without a request before the sweep deletes a session; 0 = never
    # Root-URL chats (X-Session-ID) may name a session that does not exist yet: create it on first use.
    create_sessions_on_demand: bool = False
    engine_api_key: str | None = field(default=None, repr=False)  # SGLang --api-key; never logged
    engine_admin_api_key: str | None = field(default=None, repr=False)  # SGLang --admin-api-key; never logged
    # Engine sessions open at once per engine (each holds one of its request rows); None: its --max-running-requests
    # less a quarter (engine/sessions.py); 0: no cap.
    max_engine_sessions_per_engine: int | None = None
    engine_control_timeout: float = 1.0  # bound on every control call (abort, open/close session, ready)
    journal: str | None = None  # SQLite file of sessions, turns and deletions (sessions/journal.py); None = memory only
    journal_sync: str = "normal"  # normal: survives a killed process; full: also a power loss (fsync per commit)
    # The engine runs with SGLang's --incremental-streaming-output: stream events carry deltas, not the reply so far.
    engine_incremental_streaming: bool = False
    # A streamed turn reads the engine at most once per this many milliseconds after its first chunk: the events
    # that arrived meanwhile are handled as one batch (and reach the agent in its chunks, below). 0 = every event
    # as it arrives.
    stream_coalesce_ms: float = 20.0
    # The agent's chunks (engine/pacing.py): the first text at once, then what arrived goes out every this many
    # milliseconds (0: as each read brings it) ...
    stream_chunk_ms: float = CHUNK_SECONDS * 1000
    # ... or as soon as this many tokens are held, whichever comes first (a cap that does not bind at a GPU's pace).
    stream_chunk_tokens: int = CHUNK_TOKENS
    # Tokens per engine stream event asked of the engine (SGLang's per-request stream_interval); 0 chooses by the
    # streaming mode and the reply's size (engine/pacing.py).
    engine_stream_interval: int = 0
    # Data-parallel workers (--engine-url repeated); empty means just engine_url. See engine/placement.py.
    engine_urls: tuple[str, ...] = ()
    engine_health_interval: float = 5.0  # seconds between readiness/load probes of each engine; 0 = only on demand
    replica_name: str | None = None  # behind a load balancer: minted ids are `NAME.<hex>` (deploy/nginx.py)
    # Images in requests (frontend/images.py): per request, per encoded image, per image's declared size; http(s)
    # image URLs are refused unless fetching is allowed, and then read within the byte limit and the timeout.
    max_images: int = 32
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    fetch_images: bool = False
    image_fetch_timeout: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        for url in self.engine_urls or (self.engine_url,):
            if not url.startswith("http://"):  # the engine sits on a private network; no TLS on the hot path
                problems.append(f"--engine-url must be an http:// URL, got {url!r}")
        if len(set(self.engine_bases)) != len(self.engine_bases):
            problems.append("--engine-url names the same engine twice")
        if self.engine_health_interval < 0:
            problems.append("--engine-health-interval must be >= 0 (0 probes only on /ready and failures)")
        if self.cpu_workers < 1:
            problems.append("--cpu-workers must be >= 1")
        if self.inline_below_bytes < 0:
            problems.append("--inline-below-bytes must be >= 0")
        if self.first_turn_cache_tokens < 0:
            problems.append("--first-turn-cache-tokens must be >= 0 (0 keeps no first turns)")
        if self.max_rollback < 0:
            problems.append("--max-rollback must be >= 0")
        if not self.stream_coalesce_ms >= 0:
            problems.append("--stream-coalesce-ms must be >= 0")
        if not self.stream_chunk_ms >= 0:
            problems.append("--stream-chunk-ms must be >= 0 (0 sends what each read brings)")
        if self.stream_chunk_tokens < 1:
            problems.append("--stream-chunk-tokens must be >= 1")
        if self.engine_stream_interval < 0:
            problems.append("--engine-stream-interval must be >= 0 (0 chooses by the engine's streaming mode)")
        if self.on_divergence not in DIVERGENCE_POLICIES:
            problems.append(f"--on-divergence must be one of {', '.join(DIVERGENCE_POLICIES)}")
        if self.max_segments < 1:
            problems.append("--max-segments must be >= 1")
        if self.straddled_replies not in STRADDLED_REPLIES:
            problems.append(f"--straddled-replies must be one of {', '.join(STRADDLED_REPLIES)}")
        if self.max_staleness < -1:
            problems.append("--max-staleness must be >= 0, or -1 for no bound")
        if self.stale_turns not in STALE_TURNS:
            problems.append(f"--stale-turns must be one of {', '.join(STALE_TURNS)}")
        if self.adapter_revisions not in ADAPTER_REVISIONS:
            problems.append(f"--adapter-revisions must be one of {', '.join(ADAPTER_REVISIONS)}")
        if self.max_turn_continuations < 0:
            problems.append("--max-turn-continuations must be >= 0")
        if self.request_timeout <= 0:
            problems.append("--request-timeout must be > 0")
        if self.max_engine_sessions_per_engine is not None and self.max_engine_sessions_per_engine < 0:
            problems.append("--max-engine-sessions-per-engine must be >= 0")
        if self.engine_control_timeout <= 0:
            problems.append("--engine-control-timeout must be > 0")
        if self.journal_sync not in SYNC_MODES:
            problems.append(f"--journal-sync must be {' or '.join(map(repr, SYNC_MODES))}")
        if self.tombstones < 0:
            problems.append("--tombstones must be >= 0")
        if self.session_idle_timeout < 0:
            problems.append("--session-idle-timeout must be >= 0 (0 turns the sweep off)")
        if self.max_metadata_bytes < 0:
            problems.append("--max-metadata-bytes must be >= 0")
        if self.max_header_bytes < 1024:
            problems.append("--max-header-bytes must be >= 1024")
        if self.max_sessions < 0:
            problems.append("--max-sessions must be >= 0 (0 = unbounded)")
        if self.max_fork < 1:
            problems.append("--max-fork must be >= 1")
        if self.fork_prefill not in FORK_PREFILL_MODES:
            problems.append(f"--fork-prefill must be one of {', '.join(FORK_PREFILL_MODES)}")
        if self.max_session_tokens < 0:
            problems.append("--max-session-tokens must be >= 0 (0 = unbounded)")
        if self.drain_timeout <= 0:
            problems.append("--drain-timeout must be > 0")
        if self.shutdown_timeout < 0:
            problems.append("--shutdown-timeout must be >= 0")
        if self.body_timeout <= 0:
            problems.append("--body-timeout must be > 0")
        if self.max_request_bytes < 1:
            problems.append("--max-request-bytes must be >= 1")
        if self.engine_client not in ENGINE_CLIENTS:
            problems.append(f"--engine-client must be one of {', '.join(ENGINE_CLIENTS)}")
        if self.special_tokens_in_content not in SPECIAL_TOKEN_MODES:
            problems.append(f"--special-tokens-in-content must be one of {', '.join(SPECIAL_TOKEN_MODES)}")
        if self.message_matcher not in MATCHERS:
            problems.append(f"--message-matcher must be one of {', '.join(MATCHERS)}")
        if self.replica_name is not None and not REPLICA_NAME.fullmatch(self.replica_name):
            problems.append("--replica-name must be 1-32 characters of a-z 0-9 -, starting with a letter")
        if self.max_images < 0 or self.max_image_bytes < 1 or self.max_image_pixels < 1:
            problems.append("--max-images must be >= 0, --max-image-bytes and --max-image-pixels >= 1")
        if self.image_fetch_timeout <= 0:
            problems.append("--image-fetch-timeout must be > 0")
        if not 0 <= self.port <= 65535:
            problems.append("--port must be in [0, 65535]")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels, self.fetch_images,
                           self.image_fetch_timeout)

    @property
    def session_id_prefix(self) -> str:
        """What every minted session id starts with: `NAME.` for a named replica, else nothing."""
        return f"{self.replica_name}." if self.replica_name else ""

    @property
    def engine_bases(self) -> tuple[str, ...]:
        """Every engine worker's base URL, in the order given."""
        return tuple(u.rstrip("/") for u in (self.engine_urls or (self.engine_url,)))
