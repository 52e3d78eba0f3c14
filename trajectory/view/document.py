"""The view document: what the page draws, built from training samples (trajectory/samples.py) plus what only the
server knows (each turn's finish reason, cache hits, tool calls and messages; the images themselves).

Samples are the common ground: the server builds a session's samples (one merged sample per segment) from a snapshot,
and the offline viewer reads them from a `/samples` file, so both views agree on positions, masks, logprobs, weight
versions and image spans by construction. The layout is compact for long sessions (a 64k-token segment is about
1 MB): token ids and logprobs as arrays, the loss mask as a string of 0/1, each distinct token's decoded piece once.

    {"schema": 1, "kind": "session" | "samples", "title", "header": {fact: value},
     "pieces": {"<id>": text}, "special": [ids],
     "segments": [{"label", "info", "tokens", "mask", "logprobs", "turns": [{"turn", "start", "prompt_len",
                   "completion_len", "rid", "weight_version", ...}], "weight_spans": [[version, start, end]],
                   "images": [{"span", "digest", "grid", "src"}], "experts": [[start, end]] | null,
                   "check": null | {"trainer": [logprob | null], "tolerance", "worst": [...], "metrics": {...}}}]}
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajectory import Sample

SCHEMA = 1
LOGPROB_DECIMALS = 5  # enough to read a mismatch of 1e-4; the page never needs more


@dataclass(frozen=True, slots=True)
class TurnExtras:
    """What the server's turn record adds to a sample's turn: how it ended, what the cache saved, what the agent
    sent (role and a short text per appended message) and the tool calls the reply made."""

    finish_reason: Mapping[str, Any] | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    tool_calls: Sequence[Mapping[str, Any]] = ()
    messages: Sequence[Mapping[str, Any]] = ()
    rolled_back: int = 0
    rollback_reason: str | None = None
    e2e_latency: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"finish_reason": self.finish_reason, "cached_tokens": self.cached_tokens,
                "prompt_tokens": self.prompt_tokens, "tool_calls": list(self.tool_calls),
                "messages": list(self.messages), "rolled_back": self.rolled_back,
                "rollback_reason": self.rollback_reason, "e2e_latency": self.e2e_latency}


@dataclass(frozen=True, slots=True)
class SegmentExtras:
    label: str
    turns: Sequence[TurnExtras] = ()
    image_sources: Mapping[str, str] = field(default_factory=dict)  # digest -> data URL of the image file
    check: Mapping[str, Any] | None = None  # the trainer check's overlay (rollout/view.py builds it)


def piece_table(decode: Callable[[list[int]], str], token_ids: Iterable[np.ndarray]) -> dict[str, str]:
    """Each distinct token's text, decoded alone: a few thousand decodes for a 64k-token session, not 64k."""
    arrays = [np.asarray(ids, dtype=np.int64).ravel() for ids in token_ids]
    distinct = np.unique(np.concatenate(arrays)) if arrays else np.zeros(0, dtype=np.int64)
    return {str(int(i)): decode([int(i)]) for i in distinct}


def _turn_bounds(sample: Sample) -> list[tuple[int, int]]:
    """(prompt_len, completion_len) per turn: the merged sample's metadata, a turn sample's, or the mask's runs."""
    metadata = sample.metadata
    if isinstance(metadata.get("turns"), list):
        return [(int(p), int(c)) for p, c in metadata["turns"]]
    if "prompt_len" in metadata:
        return [(int(metadata["prompt_len"]), sample.response_length)]
    mask = np.concatenate(([0], np.asarray(sample.loss_mask, dtype=np.int8), [0]))
    edges = np.flatnonzero(np.diff(mask))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _weight_spans(sample: Sample, turns: list[tuple[int, int]]) -> list[list[Any]]:
    metadata = sample.metadata
    if isinstance(metadata.get("weight_version_spans"), list):
        return [list(span) for span in metadata["weight_version_spans"]]
    if "weight_version" in metadata and turns:
        prompt_len, completion_len = turns[-1]
        return [[metadata["weight_version"], prompt_len, prompt_len + completion_len]]
    return []


def _experts(routed: np.ndarray | None) -> list[list[int]] | None:
    """[start, end) spans of the positions whose routing the engine recorded (rows not all -1)."""
    if routed is None:
        return None
    present = np.concatenate(([False], (np.asarray(routed) != -1).any(axis=1), [False]))
    edges = np.flatnonzero(present[1:] != present[:-1])
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2], strict=True)]


def segment_of_sample(sample: Sample, extras: SegmentExtras) -> dict[str, Any]:
    """One segment of the document from one sample (and what the server adds to it)."""
    n = len(sample.tokens)
    metadata = sample.metadata
    bounds = _turn_bounds(sample)
    rids = metadata.get("rids") or ([metadata["rid"]] if "rid" in metadata else [])
    versions = metadata.get("weight_versions") or (
        [metadata["weight_version"]] if "weight_version" in metadata else [])
    turns = []
    start = 0
    for k, (prompt_len, completion_len) in enumerate(bounds):
        if prompt_len >= n:
            break  # a truncated sample ends before this turn
        turn: dict[str, Any] = {
            "turn": k, "start": start, "prompt_len": prompt_len,
            "completion_len": min(completion_len, n - prompt_len),
            "rid": rids[k] if k < len(rids) else None,
            "weight_version": versions[k] if k < len(versions) else None,
        }
        if k < len(extras.turns):
            turn.update(extras.turns[k].as_dict())
        turns.append(turn)
        start = prompt_len + completion_len
    images = [{"span": list(image["span"]), "digest": image.get("digest"), "grid": image.get("image_grid_thw"),
               "src": extras.image_sources.get(str(image.get("digest")))}
              for image in metadata.get("images") or []]
    mask = np.asarray(sample.loss_mask, dtype=np.uint8)
    info = {k: metadata[k] for k in ("segment", "parent", "branch_turn", "reason", "divergence", "shared_messages")
            if k in metadata} or None
    return {
        "label": extras.label, "info": info, "status": sample.status,
        "truncated_from": metadata.get("truncated_from"),
        "tokens": np.asarray(sample.tokens).tolist(),
        "mask": (mask.astype(bool).astype(np.uint8) + ord("0")).tobytes().decode("ascii"),
        "logprobs": np.round(np.asarray(sample.rollout_log_probs, dtype=np.float64), LOGPROB_DECIMALS).tolist(),
        "turns": turns, "weight_spans": _weight_spans(sample, bounds), "images": images,
        "experts": _experts(sample.routed_experts), "check": dict(extras.check) if extras.check else None,
    }


def build_document(kind: str, title: str, header: Mapping[str, Any], segments: Sequence[dict[str, Any]],
             pieces: Mapping[str, str], special: Collection[int] = ()) -> dict[str, Any]:
    """The whole document; `special` lists the control tokens (drawn as chips) among those present."""
    present = {int(i) for i in pieces}
    return {"schema": SCHEMA, "kind": kind, "title": title, "header": dict(header), "pieces": dict(pieces),
            "special": sorted(present & set(special)), "segments": list(segments)}
