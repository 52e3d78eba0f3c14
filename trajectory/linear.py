"""A session's linear trajectory: messages, generated checkpoints, stored tokens and per-turn records.

The server works in two steps because the engine call happens in between, without the session state
being locked for its duration: `prepare` is pure (it decides rollback and builds the prompt, mutating
nothing, so a failed or aborted engine call leaves no trace) and `commit` applies rollback and append
atomically, after validating everything, once a validated engine result is in hand. `version` ties the
two: a plan built against an older state can never be committed.
"""

from __future__ import annotations

import bisect
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np
import xxhash

from .buffer import TokenBuffer
from .engine_output import GenerateResult
from .errors import (
    ForkPointError,
    InvariantError,
    RequestValidationError,
    RollbackLimitError,
    SessionError,
    UpstreamError,
)
from .families.base import ModelFamily
from .images import Image, check_runs, collect_images, expand, has_images, prompt_images, spelled
from .messages import Message, MessageMatcher, normalize_message, normalize_tools
from .mismatch import diff_tokens
from .sampling_masks import MaskBuffer, SamplingMasks
from .tito import continuation_ids, first_turn_ids

_REPORT_MAX_SEGMENTS = 32
_REPORT_MAX_TEXT = 200


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """State after a generated turn: how many messages (reply included) and tokens it covers."""

    num_messages: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """Everything `commit` needs, computed without touching the trajectory."""

    prompt_ids: np.ndarray          # int32, read-only: the engine's input_ids
    messages: list[Message]         # the normalised request messages
    tools: list[dict[str, Any]] | None
    base_checkpoints: int           # checkpoints kept
    rolled_back: int                # checkpoints dropped
    new_token_start: int            # stored ids reused as the prompt's head (0 on a full render)
    trimmed: int                    # stored tail tokens replaced (a non-template stop token)
    version: int                    # trajectory version the plan was built against
    rollback_reason: str | None = None  # why the request left the stored history (see messages.ROLLBACK_REASONS)
    routed_experts_start: int = 0   # first position whose routed experts the records do not hold yet
    merged: bool = False            # a full render that extends every stored token (`merge_plan`)
    reply_opening: str = ""         # the part of the reply the prompt already wrote: parse it + the engine's text
    messages_json: bytes | None = None  # the request's messages array as the client sent it (see `SentHistory`)
    # Every image of the prompt in order (trajectory/images.py): the engine's `image_data`; their runs of pads in
    # `prompt_ids` are expanded, the engine gets each collapsed to one pad.
    images: tuple[Image, ...] = ()
    # `prompt_ids` already encoded for the engine (a JSON array), when a caller encodes them once for many turns: a
    # primed prompt's, sent by every child of its group (session_server/api/primes.py). None: encoded per request.
    wire_ids: bytes | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.prompt_ids) - self.new_token_start


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What one generated turn produced; kept for samples, replay and GET /sessions/{id}."""

    rid: str | None
    prompt_len: int
    completion_len: int
    finish_reason: dict[str, Any]
    cached_tokens: int
    prompt_tokens: int
    weight_version: str | None
    message: Message                 # the assistant reply as stored
    trimmed: int = 0                 # tokens of the previous turn this prompt replaced
    rolled_back: int = 0
    rollback_reason: str | None = None
    e2e_latency: float | None = None
    # The completion's last tokens, so the turn stays reconstructible after a later turn trims them.
    tail_ids: tuple[int, ...] = ()
    tail_logprobs: tuple[float, ...] = ()
    routed_experts: bytes | memoryview | None = field(default=None, repr=False)  # a view into the engine body
    # SGLang's routed experts are base64 int32 [rows, layers, top_k] for positions [start, start + rows): the
    # routing of every token fed to the model this turn from `routed_experts_start` on (trajectory/samples.py
    # assemble_routed_experts places them on the trajectory's positions).
    routed_experts_start: int = 0
    # (version, start, end) of the weights that sampled completion tokens [start, end) (SGLang's weight_versions).
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    # The turn's messages replaced the stored ones: its prompt was a full render that extends every stored token
    # (`LinearTrajectory.merge_plan`), so the turns before it are no longer rollback targets.
    merged: bool = False
    # With sampling masks: the kept-id rows and sampled logprobs of the completion's last tokens (as `tail_ids`), so
    # a turn whose stop token a later prompt trimmed keeps its rows too.
    tail_mask_rows: tuple[tuple[int, ...], ...] = ()
    tail_sampling_logprobs: tuple[float, ...] = ()
    # How the turn used an engine session (engine_output.ENGINE_SESSION_MODES; None without --engine-sessions):
    # "deferred": it reused nothing, so none was opened; "without": it prefilled its whole history because no engine
    # session could be opened.
    engine_session: str | None = None
    # The LoRA adapter and revision that sampled the completion (the server pins one per session; both None: the base
    # model). A turn keeps one adapter revision from its first engine request to its last.
    adapter: str | None = None
    adapter_revision: str | None = None

    @property
    def routed_experts_rows(self) -> int:
        return max(0, self.prompt_len + self.completion_len - 1 - self.routed_experts_start)

    @property
    def last_completion_token(self) -> int | None:
        return self.tail_ids[-1] if self.tail_ids else None

    def to_dict(self, include_routed_experts: bool = False) -> dict[str, Any]:
        out = {
            "rid": self.rid, "prompt_len": self.prompt_len, "completion_len": self.completion_len,
            "finish_reason": self.finish_reason, "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens, "weight_version": self.weight_version, "message": self.message,
            "trimmed": self.trimmed, "rolled_back": self.rolled_back,
            "rollback_reason": self.rollback_reason, "e2e_latency": self.e2e_latency,
            "routed_experts_bytes": len(self.routed_experts or b""), "merged": self.merged,
            "engine_session": self.engine_session, "adapter": self.adapter,
            "adapter_revision": self.adapter_revision,
        }
        if include_routed_experts:
            raw = bytes(self.routed_experts) if self.routed_experts else b""
            # SGLang's base64 string is returned as it came (with the position it starts at); a legacy JSON list
            # payload is decoded.
            out["routed_experts"] = (None if not raw else msgspec.json.decode(raw) if raw[:1] == b"[" else
                                     {"start": self.routed_experts_start, "base64": raw.decode("ascii")})
        return out


@dataclass(frozen=True, slots=True)
class TurnDelta:
    """Everything one commit changes, as data: what `stage` validated and `apply` (or a journal replay) makes happen.

    `keep` stored tokens survive (the rest was rolled back or trimmed), then `prompt_tail` (unsampled) and the
    completion (sampled, with its logprobs) are appended; checkpoints and records from `base_checkpoints` on are
    replaced by this turn's; `messages` and `tools` are the whole lists after the turn.
    """

    version: int                    # the trajectory version it applies to
    base_checkpoints: int
    keep: int
    prompt_tail: np.ndarray         # int32
    output_ids: np.ndarray          # int32
    logprobs: np.ndarray            # float32
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    record: TurnRecord
    messages_json: bytes | None = None  # the turn's request messages as sent (TurnPlan.messages_json)
    images: tuple[Image, ...] = ()  # the prompt's images (TurnPlan.images): kept in the content-addressed store
    sampling_masks: SamplingMasks | None = None  # one row per output token, when the engine was asked for them


@dataclass(frozen=True, slots=True)
class SentHistory:
    """The last committed turn's request messages twice: as the client sent them (the JSON array's bytes) and as they
    were read (`messages`, the stored objects they matched or became).

    Why: an agent resends its whole history every turn, mostly byte for byte. A front end that knows the bytes can
    recognise the repeated part of the next request and decode, check and match only what is new
    (session_server/chat/chat_body.py); bytes equal to what was read before are read the same way again. The bytes
    are kept as their length and a 128-bit digest (XXH3, seeded at random per process), not themselves: a session
    would otherwise hold its history a second time (~4.6 B per stored token), and the digest of 20 KB costs ~0.3 us.
    A collision found by a client would only make its own session read its own earlier, checked messages."""

    end: int  # bytes of the array through its last element: its "[" and elements, not the closing "]"
    digest: bytes  # of those bytes
    messages: list[Message]

    @classmethod
    def of(cls, array: bytes, messages: list[Message]) -> SentHistory | None:
        """Of a JSON array's bytes (as msgspec delimits a value: "[" to "]"); None for an empty array."""
        end = len(array) - 1
        while end > 1 and array[end - 1] in _WHITESPACE:
            end -= 1
        return cls(end, _digest(array[:end]), messages) if end > 1 else None

    def begins(self, data: bytes) -> bool:
        """`data` begins with exactly the bytes this history was sent as, through its last element."""
        return len(data) > self.end and _digest(memoryview(data)[:self.end]) == self.digest


_WHITESPACE = b" \t\n\r"
_SEED = secrets.randbits(64)


@dataclass(frozen=True, slots=True)
class PrimedPrompt:
    """A first turn's prompt rendered and tokenized ahead of the turn (`LinearTrajectory.prime`): a GRPO group's
    parent renders its prompt once and forks into G children that each take it as their first prompt.

    `plan` is exactly what `prepare` builds for the request; a first turn whose messages, tools and template kwargs
    are the primed ones is given its ids without a render (the same ids: the render is deterministic for equal
    inputs), any other first turn renders as usual. Immutable, so every child of a fork shares it."""

    plan: TurnPlan
    template_kwargs: dict[str, Any] | None
    # The prompt's logprobs and loss mask (zeros, read-only): with its ids, the head every child's buffer adopts
    # (TokenBuffer.adopt_head), so the prompt is stored once for the whole group after the first turns too.
    zero_logprobs: np.ndarray
    zero_mask: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.plan.prompt_ids)

    @property
    def nbytes(self) -> int:
        """The bytes of the shared head (ids, logprobs, mask), held once for every trajectory that adopted it."""
        return self.plan.prompt_ids.nbytes + self.zero_logprobs.nbytes + self.zero_mask.nbytes


def _digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data, seed=_SEED)


SPECIAL_TOKEN_MODES: tuple[str, ...] = ("text", "engine")


def _equal_ids(a: np.ndarray, b: np.ndarray) -> bool:
    """`np.array_equal` of two id arrays, as one bytes comparison when they share dtype and shape: a commit compares
    the whole stored history with the prompt's head, and array_equal builds a bool array for it (9 us for 5k ids
    against 1.6 us)."""
    if a.dtype == b.dtype and a.shape == b.shape:
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


class LinearTrajectory:
    """One episode's append-only history with bounded rollback; see the module docstring for the protocol."""

    def __init__(self, family: ModelFamily, max_rollback: int = 1, matcher: str = "loose_tool_call",
                 special_tokens: str = "text") -> None:
        if max_rollback < 0:
            raise ValueError("max_rollback must be >= 0")
        if special_tokens not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"special_tokens must be one of {', '.join(SPECIAL_TOKEN_MODES)}")
        self.family = family
        # "text": control-token spellings inside message text are tokenized as text (families/control.py);
        # "engine": as the engine's own chat endpoint does (they become the control tokens).
        self.text_only = special_tokens == "text"
        self.max_rollback = max_rollback
        self.matcher = MessageMatcher(matcher)
        self.version = 0
        self.messages: list[Message] = []
        self.tools: list[dict[str, Any]] | None = None  # the last turn's tools
        # The tools rendered into the stored head (the last full render): what a canonical re-render must use.
        self.prompt_tools: list[dict[str, Any]] | None = None
        # Rollbacks committed so far, kept here because the records of the dropped turns are gone with them.
        self.rollbacks: dict[str, int] = {}
        self.checkpoints: list[Checkpoint] = []
        self.records: list[TurnRecord] = []
        # Checkpoints before the last merged turn: their message counts refer to a message list a merge replaced,
        # so they are never rollback targets.
        self.frozen = 0
        # The last turn's request messages as sent, when its front end kept them (None: read every message).
        self.sent: SentHistory | None = None
        # Every image the stored messages name, by content hash (trajectory/images.py): what a later turn sends the
        # engine again for them, and what samples carry.
        self.images: dict[str, Image] = {}
        self._buffer = TokenBuffer()
        # Sampling masks by stored position (sampling_masks.py), from the first turn that brought them on.
        self._masks: MaskBuffer | None = None
        # The first turn's prompt, rendered ahead (`prime`); None for a trajectory that was not primed.
        self.primed: PrimedPrompt | None = None

    # -- stored tokens ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._buffer.size

    @property
    def token_ids(self) -> np.ndarray:
        return self._buffer.ids

    @property
    def logprobs(self) -> np.ndarray:
        return self._buffer.logprobs

    @property
    def loss_mask(self) -> np.ndarray:
        return self._buffer.mask

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes + (self._masks.nbytes if self._masks is not None else 0)

    @property
    def sampling_masks(self) -> SamplingMasks | None:
        """One row per stored token (empty where the model did not sample it), or None when no turn had masks."""
        return None if self._masks is None else self._masks.masks()

    def turn_masks(self, turn: int) -> SamplingMasks | None:
        """The rows of `turn_tokens(turn)`'s positions, the trimmed tail restored from the record as its ids are."""
        if self._masks is None:
            return None
        record = self.records[turn]
        end = record.prompt_len + record.completion_len
        trimmed = self.records[turn + 1].trimmed if turn + 1 < len(self.records) else 0
        if not trimmed:
            return self._masks.masks(end)
        if len(record.tail_mask_rows) < trimmed:  # the turn had no masks: its rows are empty
            return SamplingMasks.concat([self._masks.masks(end - trimmed), SamplingMasks.from_rows(
                [()] * trimmed, [0.0] * trimmed)])
        return SamplingMasks.concat([self._masks.masks(end - trimmed), SamplingMasks.from_rows(
            record.tail_mask_rows[-trimmed:], record.tail_sampling_logprobs[-trimmed:])])

    def turn_tokens(self, turn: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logprobs) of turn `turn`'s prompt + completion exactly as the engine saw and sampled them.

        Logprobs are 0.0 over the prompt. A later turn may have replaced this turn's final stop token; the
        record keeps it, so the sample is restored here.
        """
        record = self.records[turn]
        end = record.prompt_len + record.completion_len
        ids = self._buffer.ids[:end].copy()
        logprobs = self._buffer.logprobs[:end].copy()
        logprobs[: record.prompt_len] = 0.0
        if turn + 1 < len(self.records) and (trimmed := self.records[turn + 1].trimmed):
            ids[end - trimmed:] = record.tail_ids[-trimmed:]
            logprobs[end - trimmed:] = record.tail_logprobs[-trimmed:]
        return ids, logprobs

    # -- prepare / commit ------------------------------------------------------------------------------
    def prepare(self, messages: Any, tools: Any = None, template_kwargs: dict[str, Any] | None = None,
                messages_json: bytes | None = None) -> TurnPlan:
        """Match the request against the history, decide rollback and build the prompt. Mutates nothing.

        `template_kwargs` (the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`) reach the template
        for this turn's new text only: stored tokens are what the model saw and are never re-rendered.
        `messages_json`: the bytes `messages` were read from, kept as `sent` once the turn commits.
        """
        # Read first: a plan built while a commit runs elsewhere (a pool thread) is then stale, never wrong.
        version = self.version
        if self.primed is not None and not self.checkpoints:
            primed = self._primed_plan(self.primed, messages, tools, template_kwargs, messages_json, version)
            if primed is not None:
                return primed
        # Tools belong to the turn, not to the history: a request that omits or changes them is matched on its
        # messages only, and its appended messages are rendered with its own tools.
        tools = normalize_tools(tools)
        msgs, matched, reason = self.matcher.match_detail(self.messages, messages)
        keep = self.kept_turns(matched)
        if keep is None:
            raise RollbackLimitError(
                f"history diverges at message {matched} ({reason}); rolling back "
                f"{len(self.checkpoints) - self._last_checkpoint_within(matched)} turns exceeds "
                f"max_rollback={self.max_rollback}" + (f" or reaches before the merged turn {self.frozen + 1}"
                                                       if self.frozen else "")
            )
        dropped = len(self.checkpoints) - keep
        images = self._prompt_images(msgs, messages, matched)
        if keep == 0:
            prompt = self._expanded(first_turn_ids(self.family, msgs, tools, template_kwargs, self.text_only), images)
            trim = reused = 0
        else:
            base = self.checkpoints[keep - 1]
            appended = self.family.appended_messages(msgs, base.num_messages)
            trim, new_ids = continuation_ids(
                self.family, self.records[keep - 1].last_completion_token, appended, tools,
                template_kwargs, self.text_only, self.records[keep - 1].message,
            )
            if images:  # the stored head holds the earlier images' runs already
                new_ids = self._expanded(new_ids, images[len(images) - len(prompt_images(appended)):])
            reused = base.num_tokens - trim
            prompt = np.concatenate([self._buffer.ids[:reused], new_ids])
        if images and self.family.vision is not None:  # a stray pad (one the model generated) would shift them all
            check_runs(prompt, self.family.vision, images)
        prompt.flags.writeable = False
        return TurnPlan(prompt_ids=prompt, messages=msgs, tools=tools, base_checkpoints=keep, rolled_back=dropped,
                        new_token_start=reused, trimmed=trim, version=version,
                        rollback_reason=reason if dropped else None,
                        routed_experts_start=min(self.routed_experts_covered(keep), reused),
                        reply_opening=self.family.opened_reply(prompt), messages_json=messages_json,
                        images=images)

    def prime(self, messages: Any, tools: Any = None, template_kwargs: dict[str, Any] | None = None,
              messages_json: bytes | None = None) -> PrimedPrompt:
        """Render and tokenize the first turn's prompt now, without a turn: what `prepare` of the same request gives,
        kept to be taken by the first turn (or by every child of a fork at the prompt, `fork(0)`). Mutates nothing:
        the caller stores it with `set_primed` (a render may run off the loop). ForkPointError once a turn exists."""
        if self.checkpoints:
            raise ForkPointError("a session is primed before its first turn; this one has turns")
        plan = self.prepare(messages, tools, template_kwargs, messages_json)
        n = len(plan.prompt_ids)
        logprobs, mask = np.zeros(n, np.float32), np.zeros(n, np.uint8)
        logprobs.flags.writeable = mask.flags.writeable = False
        return PrimedPrompt(plan=plan, template_kwargs=None if template_kwargs is None else dict(template_kwargs),
                            zero_logprobs=logprobs, zero_mask=mask)

    def set_primed(self, primed: PrimedPrompt) -> None:
        """Keep `primed` (from `prime`) as the first turn's prompt; ForkPointError if a turn committed since."""
        if self.checkpoints or self.version != primed.plan.version:
            raise ForkPointError("the session took a turn while its prompt was primed")
        self.primed = primed
        self.sent = None if primed.plan.messages_json is None else SentHistory.of(primed.plan.messages_json,
                                                                                 primed.plan.messages)

    def _primed_plan(self, primed: PrimedPrompt, messages: Any, tools: Any, template_kwargs: dict[str, Any] | None,
                     messages_json: bytes | None, version: int) -> TurnPlan | None:
        """The primed plan for a request that renders exactly as the primed one (the same normalised messages, tools
        and template kwargs), restamped with this request's version and bytes; None for any other request."""
        plan = primed.plan
        if normalize_tools(tools) != plan.tools or (template_kwargs or None) != (primed.template_kwargs or None):
            return None
        stored = plan.messages
        if not isinstance(messages, list) or len(messages) != len(stored):
            return None
        for i, raw in enumerate(messages):  # exactly the primed messages once normalised (no loose matching)
            if not (raw is stored[i] or raw == stored[i] or normalize_message(i, raw) == stored[i]):
                return None
        return replace(plan, version=version, messages_json=messages_json)

    def _prompt_images(self, msgs: list[Message], raw: Any, matched: int) -> tuple[Image, ...]:
        """The prompt's images in order: the request's own (`raw` as a front end read it) or, for those it names but
        does not carry (a Responses history), the ones stored; () without images. A text family looks only at the
        messages past the `matched` stored ones (those were looked at when they came): its turn's cost stays with
        what is new."""
        if self.family.vision is None:
            if has_images(msgs[matched:]):
                raise RequestValidationError(f"family {self.family.name} takes text only: a message holds an image")
            return ()
        if not has_images(msgs):
            return ()
        known = {**self.images, **collect_images(raw)}
        try:
            return tuple(known[digest] for digest in prompt_images(msgs))
        except KeyError as exc:
            raise RequestValidationError(f"image {exc.args[0]} is neither in the request nor in the session") from None

    def _expanded(self, ids: np.ndarray, images: Sequence[Image]) -> np.ndarray:
        """Rendered ids (one pad per image) with each image's pad expanded to its run, as the engine expands it."""
        vision = self.family.vision
        if vision is None:
            return ids
        return expand(ids, vision.tokens.pad, [vision.count(image) for image in images])

    def _last_checkpoint_within(self, matched: int) -> int:
        return bisect.bisect_right(self.checkpoints, matched, lo=self.frozen, key=lambda c: c.num_messages)

    def kept_turns(self, matched: int) -> int | None:
        """How many turns a request that repeats the first `matched` stored messages keeps; None if it would roll
        back more than `max_rollback` turns or into the turns before a merge (their message counts are stale)."""
        keep = self._last_checkpoint_within(matched)
        if len(self.checkpoints) - keep > self.max_rollback or keep == self.frozen > 0:
            return None
        return keep

    def merge_plan(self, full: TurnPlan) -> TurnPlan | None:
        """`full` (a first-turn plan of another trajectory: a full render) as a turn of this one, if its prompt
        extends every stored token -- as a continuation would, the previous turn's non-template stop token may be
        replaced by the template's -- else None.

        The merged turn keeps every stored token and replaces the stored messages by the request's: a harness that
        re-sends its history in another shape (a new system prompt, rewritten tool-call text) whose render still
        begins with exactly what the model saw and sampled stays one sequence, not a second sample that repeats it.
        """
        if not self.records or full.base_checkpoints or full.rolled_back:
            return None
        version = self.version
        last = self.records[-1].last_completion_token
        trim = self.family.trimmed_tokens(last)
        stored = self._buffer.ids
        keep = len(stored) - trim
        prompt = full.prompt_ids
        if len(prompt) <= keep or not _equal_ids(prompt[:keep], stored[:keep]):
            return None
        return TurnPlan(prompt_ids=prompt, messages=full.messages, tools=full.tools,
                        base_checkpoints=len(self.checkpoints), rolled_back=0, new_token_start=keep, trimmed=trim,
                        version=version, routed_experts_start=min(self.routed_experts_covered(), keep), merged=True,
                        reply_opening=full.reply_opening, messages_json=full.messages_json, images=full.images)

    def routed_experts_covered(self, turns: int | None = None) -> int:
        """How many leading positions the first `turns` records' routed experts cover without a gap."""
        covered = 0
        for record in self.records[:turns]:
            if record.routed_experts is not None and record.routed_experts_start <= covered:
                covered = max(covered, record.routed_experts_start + record.routed_experts_rows)
        return covered

    def _check_plan(self, plan: TurnPlan, result: GenerateResult) -> int:
        """Validate everything before mutating; returns how many stored tokens the commit keeps."""
        if plan.version != self.version:
            raise InvariantError(f"stale plan: built against version {plan.version}, trajectory is at {self.version}")
        if plan.base_checkpoints + plan.rolled_back != len(self.checkpoints):
            raise InvariantError("plan checkpoints do not match the trajectory")
        if not 0 <= plan.trimmed <= self.family.max_trim_tokens:
            raise InvariantError(f"plan trims {plan.trimmed} tokens; family {self.family.name} allows "
                                 f"{self.family.max_trim_tokens}")
        base_tokens = self.checkpoints[plan.base_checkpoints - 1].num_tokens if plan.base_checkpoints else 0
        keep = base_tokens - plan.trimmed
        prompt = plan.prompt_ids
        if len(prompt) < keep or not _equal_ids(prompt[:keep], self._buffer.ids[:keep]):
            raise InvariantError(f"stored ids[:{keep}] are not a prefix of the prompt ({len(prompt)} tokens)")
        if len(result.output_ids) != len(result.logprobs):
            raise InvariantError("engine result has misaligned output ids and logprobs")
        if result.sampling_masks is not None and len(result.sampling_masks) != len(result.output_ids):
            raise InvariantError("engine result has a sampling-mask row count other than its output tokens'")
        if plan.images and result.prompt_tokens != len(prompt):  # the engine's grid differs from ours
            raise UpstreamError(f"the engine expanded the prompt's {len(plan.images)} images to "
                                f"{result.prompt_tokens} prompt tokens, expected {len(prompt)}", rule="image_tokens")
        return keep

    def commit(self, plan: TurnPlan, result: GenerateResult, reply_message: dict[str, Any]) -> TurnRecord:
        """Apply the plan's rollback and append prompt tail + completion as a new checkpoint, atomically."""
        return self.apply(self.stage(plan, result, reply_message))

    def stage(self, plan: TurnPlan, result: GenerateResult, reply_message: dict[str, Any]) -> TurnDelta:
        """Validate a commit and build exactly what it will change, mutating nothing.

        Split from `apply` so that a journal can write the change to disk before it happens in memory (a reply is
        never sent for a turn that is not on disk) and so a restart can replay the same deltas (trajectory.restore).
        """
        keep = self._check_plan(plan, result)
        try:
            reply = normalize_message(len(plan.messages), reply_message)
        except RequestValidationError as exc:
            raise InvariantError(f"invalid reply message: {exc.message}") from exc
        if reply["role"] != "assistant":
            raise InvariantError(f"reply message has role {reply['role']!r}, expected 'assistant'")
        n_out = len(result.output_ids)
        tail = max(1, self.family.max_trim_tokens)
        masks = result.sampling_masks
        tail_rows = masks.rows(max(0, n_out - tail), n_out) if masks is not None and n_out else None
        record = TurnRecord(
            rid=result.rid, prompt_len=len(plan.prompt_ids), completion_len=n_out,
            finish_reason=result.finish_reason, cached_tokens=result.cached_tokens,
            prompt_tokens=result.prompt_tokens, weight_version=result.weight_version, message=reply,
            trimmed=plan.trimmed, rolled_back=plan.rolled_back, rollback_reason=plan.rollback_reason,
            e2e_latency=result.e2e_latency,
            tail_ids=tuple(np.asarray(result.output_ids[-tail:]).tolist()) if n_out else (),
            tail_logprobs=tuple(np.asarray(result.logprobs[-tail:]).tolist()) if n_out else (),
            routed_experts=result.routed_experts,
            routed_experts_start=plan.routed_experts_start if result.routed_experts is not None else 0,
            weight_versions=result.weight_versions, merged=plan.merged, engine_session=result.engine_session,
            adapter=result.adapter, adapter_revision=result.adapter_revision,
            tail_mask_rows=() if tail_rows is None else tuple(
                tuple(tail_rows.row(i).tolist()) for i in range(len(tail_rows))),
            tail_sampling_logprobs=() if tail_rows is None else tuple(tail_rows.logprobs.tolist()),
        )
        return TurnDelta(
            version=self.version, base_checkpoints=plan.base_checkpoints, keep=keep,
            prompt_tail=plan.prompt_ids[keep:], output_ids=result.output_ids, logprobs=result.logprobs,
            messages=[*plan.messages, reply], tools=plan.tools, record=record, messages_json=plan.messages_json,
            images=plan.images, sampling_masks=masks,
        )

    def apply(self, delta: TurnDelta) -> TurnRecord:
        """Make a staged (or journaled) turn happen. Everything was validated by `stage`: nothing fails halfway."""
        fits = delta.base_checkpoints <= len(self.checkpoints) and delta.keep <= self.num_tokens
        if delta.version != self.version or not fits:
            raise InvariantError(f"delta for version {delta.version} does not fit trajectory version {self.version}")
        record = delta.record
        if delta.sampling_masks is not None and self._masks is None:
            self._masks = MaskBuffer(self._buffer.size)  # the positions stored so far: empty rows
        if self._masks is not None:
            self._masks.truncate(delta.keep)
            self._masks.append(len(delta.prompt_tail), None)
            self._masks.append(len(delta.output_ids), delta.sampling_masks)
        self._buffer.truncate(delta.keep)
        primed = self.primed
        if primed is not None and not self._buffer.size and len(delta.prompt_tail) == primed.num_tokens \
                and _equal_ids(delta.prompt_tail, primed.plan.prompt_ids):  # the primed prompt: held by reference
            self._buffer.adopt_head(primed.plan.prompt_ids, primed.zero_logprobs, primed.zero_mask)
        else:
            self._buffer.append(delta.prompt_tail, None, sampled=False)
        self._buffer.append(delta.output_ids, delta.logprobs, sampled=True)
        del self.checkpoints[delta.base_checkpoints:]
        del self.records[delta.base_checkpoints:]
        self.messages = delta.messages
        if delta.images:
            self.images = {**self.images, **{image.digest: image for image in delta.images}}  # replaced, not mutated
        self.sent = None if delta.messages_json is None else SentHistory.of(delta.messages_json,
                                                                             delta.messages[:-1])
        self.tools = delta.tools
        if delta.base_checkpoints == 0 or record.merged:  # the turn's prompt was a full render with these tools
            self.prompt_tools = delta.tools
        if record.merged:
            self.frozen = delta.base_checkpoints
        if record.rolled_back:
            reason = record.rollback_reason or "retry"
            self.rollbacks = {**self.rollbacks, reason: self.rollbacks.get(reason, 0) + 1}
        self.checkpoints.append(Checkpoint(num_messages=len(self.messages), num_tokens=self._buffer.size))
        self.records.append(record)
        self.version += 1
        return record

    # -- inspection ------------------------------------------------------------------------------------
    def snapshot(self) -> LinearTrajectory:
        """A detached copy that can be read in another thread while this trajectory keeps committing turns.

        The token arrays are copied, not viewed: a commit that rolls back or trims truncates the buffer and
        appends in place, so a view could change under its reader. Everything else is immutable once stored
        (a commit appends to or truncates the lists, and replaces `messages` and `tools`), so shallow copies of
        the lists suffice. Cost: a memcpy of 9 bytes per token plus one pointer per message and turn.
        """
        snap = LinearTrajectory.__new__(LinearTrajectory)
        snap.family, snap.max_rollback, snap.matcher = self.family, self.max_rollback, self.matcher
        snap.text_only, snap.frozen, snap.sent = self.text_only, self.frozen, self.sent
        snap.version, snap.tools, snap.prompt_tools = self.version, self.tools, self.prompt_tools
        snap.rollbacks = self.rollbacks  # replaced, never mutated, on commit
        snap.images = self.images  # likewise
        snap.messages, snap.checkpoints, snap.records = list(self.messages), list(self.checkpoints), list(self.records)
        snap._buffer = self._buffer.copy()
        snap._masks = None if self._masks is None else self._masks.copy()
        snap.primed = self.primed
        return snap

    def fork(self, turns: int | None = None) -> LinearTrajectory:
        """A new trajectory holding this one's first `turns` turns (all by default): what the next turn after them
        would send the engine, it sends (trajectory/forks.py). The stored tokens are shared copy on write
        (TokenBuffer.share); lists are copied shallowly (a pointer per message and turn), the rest is immutable once
        stored. ForkPointError unless `turns` is a turn boundary a rollback could reach: 1..turns, after a merge; or 0
        for a primed trajectory with no turn yet (a fork at the prompt: every child shares the primed prompt)."""
        count = len(self.checkpoints)
        turns = count if turns is None else turns
        at_prompt = turns == count == 0 and self.primed is not None
        if not at_prompt and (not (0 < turns <= count) or turns <= self.frozen):
            raise ForkPointError(f"cannot fork at turn {turns}: the trajectory's turn boundaries are "
                                 f"{max(1, self.frozen + 1)}..{count}" if count else
                                 "cannot fork a session before its first turn")
        end = self.checkpoints[turns - 1] if turns else Checkpoint(num_messages=0, num_tokens=0)
        child = LinearTrajectory.__new__(LinearTrajectory)
        child.family, child.max_rollback, child.matcher = self.family, self.max_rollback, self.matcher
        child.text_only, child.frozen = self.text_only, self.frozen
        child.version, child.tools, child.prompt_tools = self.version, self.tools, self.prompt_tools
        child.rollbacks = self.rollbacks  # replaced, never mutated, on commit
        child.checkpoints, child.records = self.checkpoints[:turns], self.records[:turns]
        child.messages = self.messages[:end.num_messages]
        at_end = turns == count
        child.sent = self.sent if at_end else None  # the bytes stand for the whole last request: only at the end
        child.images = self.images if at_end or not self.images else {
            d: self.images[d] for d in prompt_images(child.messages)}
        child._buffer = self._buffer.share(end.num_tokens)
        child._masks = None  # sampling masks are appended in place, so the child gets its own rows up to the fork
        if self._masks is not None:
            child._masks = self._masks.copy()
            child._masks.truncate(end.num_tokens)
        child.primed = self.primed
        return child

    def mismatch_report(self) -> dict[str, Any]:
        """Stored ids vs. a canonical re-render of the stored messages: where they differ and who wrote it.

        Differences inside generated (loss-masked) tokens are expected (e.g. Qwen3 dropping earlier
        reasoning, re-serialised tool arguments); differences in template glue point to a family bug.
        """
        stored = self._buffer.ids
        canonical: list[int] = []
        if self.messages:
            try:
                text = self.family.render(spelled(self.messages), self.prompt_tools, add_generation_prompt=False)
                # The stored ids end at the last generated token; the template's trailer after it is not ours yet.
                canonical = self.family.encode(text.removesuffix(self.family.message_trailer))
                if has_images(self.messages):  # each image's run as the engine expanded it
                    canonical = self._expanded(np.asarray(canonical, np.int32), [
                        self.images[d] for d in prompt_images(self.messages)]).tolist()
            except SessionError as exc:
                return {"error": exc.message}
        opcodes = diff_tokens(stored, canonical, self.family.special_token_ids)
        in_assistant = [self._in_completion(a0, a1) for _, a0, a1, _, _ in opcodes]

        def text_of(ids: Sequence[int]) -> str:
            return self.family.decode(ids[:_REPORT_MAX_TEXT])[:_REPORT_MAX_TEXT]

        segments = [
            {"op": op, "stored": [a0, a1], "canonical": [b0, b1], "in_assistant": inside,
             "stored_text": text_of(stored[a0:a1].tolist()), "canonical_text": text_of(canonical[b0:b1])}
            for (op, a0, a1, b0, b1), inside in zip(opcodes[:_REPORT_MAX_SEGMENTS], in_assistant, strict=False)
        ]
        return {
            "equal": not opcodes, "stored_tokens": len(stored), "canonical_tokens": len(canonical),
            "assistant_only": all(in_assistant), "num_segments": len(opcodes), "segments": segments,
        }

    def _in_completion(self, start: int, end: int) -> bool:
        """Does stored span [start, end) lie in an assistant message: a completion or the header just before it?

        The header counts because a re-render writes things there that belong to the assistant message (Qwen3's
        empty think block) and because BPE merges the header's newline with a reply that starts with one, so a
        diff may align such a difference on either side of the boundary. An empty span (an insertion) counts
        when it touches the message, e.g. a stop token the model never generated.
        """
        header = len(self.family.encode(self.family.assistant_header))
        for record in self.records:
            lo, hi = record.prompt_len - header, record.prompt_len + record.completion_len
            if (lo <= start <= hi) if start == end else (start < hi and end > lo):
                return True
        return False

    def to_dict(self, include_routed_experts: bool = False) -> dict[str, Any]:
        """JSON-ready view for GET /sessions/{id} (no heavy payloads unless asked)."""
        return {
            "family": self.family.name, "version": self.version, "num_tokens": self.num_tokens,
            "nbytes": self.nbytes, "max_rollback": self.max_rollback, "matcher": self.matcher.mode,
            "messages": self.messages, "tools": self.tools, "prompt_tools": self.prompt_tools,
            "rollbacks": sum(self.rollbacks.values()), "rollbacks_by_reason": dict(self.rollbacks),
            "checkpoints": [{"num_messages": c.num_messages, "num_tokens": c.num_tokens} for c in self.checkpoints],
            "records": [r.to_dict(include_routed_experts) for r in self.records],
            "token_ids": self._buffer.ids.tolist(),
        }

