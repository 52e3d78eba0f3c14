"""A session's view document (trajectory/view/document.py), built on the CPU pool from a detached snapshot.

The snapshot is taken on the event loop without the session lock: every change to a trajectory happens in
synchronous code on the loop (turns/commit.py), so a synchronous copy cannot interleave with one, and a viewer never
waits behind a turn or makes a turn wait for it. Everything else -- the segments' merged samples, each distinct
token decoded alone with the session's tokenizer, the images as data URLs, the JSON encode -- runs here, off the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec

from trajectory import LinearTrajectory, ModelFamily, Segment, TurnRecord, build_merged_sample
from trajectory.view import SegmentExtras, TurnExtras, build_document, piece_table, segment_of_sample

MESSAGE_PREVIEW = 400  # characters of an appended message shown on hover

_encoder = msgspec.json.Encoder()


def _preview(message: dict[str, Any]) -> dict[str, Any]:
    text = message.get("content")
    out = {"role": message.get("role"), "text": text[:MESSAGE_PREVIEW] if isinstance(text, str) else None}
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _tool_calls(record: TurnRecord) -> list[dict[str, Any]]:
    return [{"name": call.get("function", {}).get("name"), "arguments": call.get("function", {}).get("arguments")}
            for call in record.message.get("tool_calls") or []]


def turn_extras(traj: LinearTrajectory) -> list[TurnExtras]:
    """Per turn: the record's facts and the messages the agent appended before it (by the checkpoints' message
    counts: turn k's request added messages[count(k-1) : count(k) - 1], the last one being its reply)."""
    out = []
    before = 0
    for k, record in enumerate(traj.records):
        after = traj.checkpoints[k].num_messages if k < len(traj.checkpoints) else len(traj.messages)
        appended = traj.messages[before:max(before, after - 1)]
        out.append(TurnExtras(
            finish_reason=record.finish_reason, cached_tokens=record.cached_tokens,
            prompt_tokens=record.prompt_tokens, tool_calls=_tool_calls(record),
            messages=[_preview(m) for m in appended], rolled_back=record.rolled_back,
            rollback_reason=record.rollback_reason, e2e_latency=record.e2e_latency,
        ))
        before = after
    return out


def session_document(snapshot: Sequence[tuple[Segment, LinearTrajectory]], family: ModelFamily,
                     header: dict[str, Any]) -> bytes:
    """The JSON body of GET /view/api/sessions/{id}: one document segment per segment with a generated turn."""
    segments, samples = [], []
    for segment, traj in snapshot:
        if not traj.records:
            continue
        sample = build_merged_sample(traj)
        sample = dataclasses.replace(sample, metadata={**sample.metadata, **segment.info()})
        samples.append(sample)
        sources = {digest: image.data_url() for digest, image in traj.images.items()}
        extras = SegmentExtras(label=f"segment {segment.id}", turns=turn_extras(traj), image_sources=sources)
        segments.append(segment_of_sample(sample, extras))
    versions = sorted({str(r.weight_version) for _, t in snapshot for r in t.records if r.weight_version is not None})
    header = {**header, "family": family.name, "weight versions": ", ".join(versions) or None}
    pieces = piece_table(family.decode, [s.tokens for s in samples])
    doc = build_document("session", f"session {header['session']}", header, segments, pieces, family.special_token_ids)
    return _encoder.encode(doc)
