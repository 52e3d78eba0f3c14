"""A trajectory as a sequence of stored turns, and back: what a journal writes and what a restart replays.

Pure (no I/O): the server's journal (session_server/sessions/journal.py) owns the database and calls these. A stored
turn holds only what the turn changed -- the appended prompt tokens, the completion and its logprobs as little-endian
int32/float32 blobs, the messages past the longest unchanged prefix, the tools only when they changed, the turn's
record (and its routed experts as a separate blob) -- so a journal grows with the new tokens, never with the history.
Replaying every stored turn of a session, in order, with `LinearTrajectory.apply` makes the same mutations the live
commits made, so the restored trajectory is the live one exactly (tokens, logprobs, loss mask, messages, records,
rollbacks): rolled-back turns are replayed too, then dropped by the turn that rolled them back, as they were live.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from .errors import InvariantError
from .families.base import ModelFamily
from .linear import LinearTrajectory, PrimedPrompt, TurnDelta, TurnRecord
from .messages import Message
from .sampling_masks import SamplingMasks

_encoder = msgspec.json.Encoder()
_TUPLE_FIELDS = frozenset(
    f.name for f in dataclasses.fields(TurnRecord) if isinstance(f.default, tuple)
)
_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(TurnRecord))


@dataclass(frozen=True, slots=True)
class StoredTurn:
    """One committed turn as a journal row: plain ints and bytes, nothing that needs the trajectory to read."""

    version: int
    base_checkpoints: int
    keep: int
    prompt_tail: bytes       # int32 little-endian
    output_ids: bytes        # int32 little-endian
    logprobs: bytes          # float32 little-endian
    messages_kept: int       # leading messages of the previous list that the turn kept as they were
    messages: bytes          # JSON list: the messages after those
    tools: bytes | None      # JSON, only when the turn's tools differ from the previous turn's
    tools_changed: bool
    record: bytes            # JSON object: the TurnRecord without its routed experts
    routed_experts: bytes | None
    sampling_masks: bytes | None = None  # `encode_masks` of the completion's rows, when the turn had them


def encode_masks(masks: SamplingMasks) -> bytes:
    """Rows as one blob: int64 offsets (rows + 1), then int32 ids, then float32 logprobs, little-endian."""
    return b"".join((np.ascontiguousarray(masks.offsets, dtype="<i8").tobytes(),
                     np.ascontiguousarray(masks.ids, dtype="<i4").tobytes(),
                     np.ascontiguousarray(masks.logprobs, dtype="<f4").tobytes()))


def decode_masks(blob: bytes, rows: int) -> SamplingMasks:
    """`encode_masks`' blob of `rows` rows; InvariantError if it is not one."""
    head = (rows + 1) * 8
    offsets = np.frombuffer(blob[:head], dtype="<i8").astype(np.int64)
    total = int(offsets[-1]) if len(offsets) == rows + 1 else -1
    if total < 0 or len(blob) != head + total * 4 + rows * 4 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        raise InvariantError(f"stored sampling masks do not make {rows} rows")
    ids = np.frombuffer(blob[head:head + total * 4], dtype="<i4").astype(np.int32)
    return SamplingMasks(ids, offsets, np.frombuffer(blob[head + total * 4:], dtype="<f4").astype(np.float32))


def _common_prefix(old: list[Message], new: list[Message]) -> int:
    n = 0
    for a, b in zip(old, new, strict=False):
        if a is not b and a != b:
            break
        n += 1
    return n


def store_turn(
    delta: TurnDelta, prev_messages: list[Message], prev_tools: list[dict[str, Any]] | None
) -> StoredTurn:
    """Encode a staged turn against the lists it replaces (`prev_*`: the trajectory's before the turn)."""
    kept = _common_prefix(prev_messages, delta.messages)
    tools_changed = delta.tools != prev_tools
    record = delta.record
    return StoredTurn(
        version=delta.version,
        base_checkpoints=delta.base_checkpoints,
        keep=delta.keep,
        prompt_tail=np.ascontiguousarray(delta.prompt_tail, dtype="<i4").tobytes(),
        output_ids=np.ascontiguousarray(delta.output_ids, dtype="<i4").tobytes(),
        logprobs=np.ascontiguousarray(delta.logprobs, dtype="<f4").tobytes(),
        messages_kept=kept,
        messages=_encoder.encode(delta.messages[kept:]),
        tools=_encoder.encode(delta.tools) if tools_changed else None,
        tools_changed=tools_changed,
        record=_encoder.encode(dataclasses.replace(record, routed_experts=None)),
        routed_experts=None if record.routed_experts is None else bytes(record.routed_experts),
        sampling_masks=None if delta.sampling_masks is None else encode_masks(delta.sampling_masks),
    )


def _record(raw: bytes, routed_experts: bytes | None) -> TurnRecord:
    fields = msgspec.json.decode(raw)
    if not isinstance(fields, dict) or not fields.keys() <= _RECORD_FIELDS:
        raise InvariantError("stored turn record has unknown fields")
    for name in _TUPLE_FIELDS & fields.keys():
        fields[name] = tuple(fields[name])
    if fields.get("tail_mask_rows"):  # JSON arrays back to tuples of ids
        fields["tail_mask_rows"] = tuple(tuple(row) for row in fields["tail_mask_rows"])
    if fields.get("weight_versions") is not None:  # JSON arrays back to the record's (version, start, end) tuples
        fields["weight_versions"] = tuple(tuple(span) for span in fields["weight_versions"])
    fields["routed_experts"] = routed_experts
    return TurnRecord(**fields)


def load_turn(stored: StoredTurn, trajectory: LinearTrajectory) -> TurnDelta:
    """Decode a stored turn against the trajectory it applies to (the one built from the turns before it)."""
    if stored.messages_kept > len(trajectory.messages):
        raise InvariantError(f"stored turn keeps {stored.messages_kept} messages of {len(trajectory.messages)}")
    ids = np.frombuffer(stored.output_ids, dtype="<i4").astype(np.int32)
    logprobs = np.frombuffer(stored.logprobs, dtype="<f4").astype(np.float32)
    if len(ids) != len(logprobs):
        raise InvariantError("stored turn has misaligned output ids and logprobs")
    tail = msgspec.json.decode(stored.messages)
    return TurnDelta(
        version=stored.version,
        base_checkpoints=stored.base_checkpoints,
        keep=stored.keep,
        prompt_tail=np.frombuffer(stored.prompt_tail, dtype="<i4").astype(np.int32),
        output_ids=ids,
        logprobs=logprobs,
        messages=[*trajectory.messages[: stored.messages_kept], *tail],
        tools=msgspec.json.decode(stored.tools or b"null") if stored.tools_changed else trajectory.tools,
        record=_record(stored.record, stored.routed_experts),
        sampling_masks=None if stored.sampling_masks is None else decode_masks(stored.sampling_masks, len(ids)),
    )


def restore_trajectory(
    family: ModelFamily, turns: list[StoredTurn], *, max_rollback: int = 1, matcher: str = "loose_tool_call",
    special_tokens: str = "text", cuts: Sequence[tuple[int, int]] = (), primed: PrimedPrompt | None = None,
) -> LinearTrajectory:
    """Rebuild a trajectory by replaying its stored turns in order; raises InvariantError if they do not chain.
    `special_tokens` is the serving trajectory's mode (LinearTrajectory), which its later turns keep using. `cuts`:
    a forked session's (version, turns) forks (trajectory/forks.py), each made when the replay reaches its version.
    `primed`: the primed prompt it held (rendered again from its journaled request, shared by a group), set before
    the replay, so a first turn that took it holds it by reference again and a turnless one takes it."""
    trajectory = LinearTrajectory(family, max_rollback=max_rollback, matcher=matcher, special_tokens=special_tokens)
    if primed is not None:
        trajectory.set_primed(primed)
    pending = list(cuts)
    for stored in [*turns, None]:
        while pending and pending[0][0] == trajectory.version:
            kept = pending.pop(0)[1]
            if kept or trajectory.checkpoints:  # a fork at the prompt (turns 0) of a turnless one: nothing to cut
                trajectory = trajectory.fork(kept)
        if stored is not None:
            trajectory.apply(load_turn(stored, trajectory))
    if pending:
        raise InvariantError(f"the stored turns end at version {trajectory.version} before the fork at {pending[0]}")
    return trajectory
