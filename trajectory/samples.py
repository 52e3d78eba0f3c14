"""Training samples from a trajectory (docs/design.md section 6), truncation, and their two wire encodings.

All arrays of a sample have the same length as `tokens` (the loss mask and logprobs are not cut to the
response), so a consumer never has to guess an offset; `response_length` counts the tokens after the
first turn's prompt, so `x[-response_length:]` is the response part in slime/miles' convention.
Decoders validate dtypes and shapes: a sample that reaches a trainer is well-formed or rejected.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .images import mrope_positions, prompt_images, runs
from .linear import LinearTrajectory, TurnRecord
from .sampling_masks import SamplingMasks
from .session_segments import Segment

# "aborted": the episode was ended by the infrastructure (trajectory/infrastructure.py), never by the model
STATUSES = ("completed", "truncated", "aborted")
# SGLang's initial weight_version (server_args.weight_version) before any update names one.
INITIAL_VERSION = "default"
_FORMAT = "trajectory-samples/v1"
_ARRAYS = (("tokens", np.int32), ("loss_mask", np.uint8), ("rollout_log_probs", np.float32))
# tensors a sample may carry
_OPTIONAL = ("routed_experts", "pixel_values", "image_grid_thw", "mrope_positions", "sampling_mask_ids",
             "sampling_mask_offsets", "sampling_log_probs", "image_bytes", "image_byte_offsets")
_MASK_ARRAYS = (("sampling_mask_ids", np.int32), ("sampling_mask_offsets", np.int64),
                ("sampling_log_probs", np.float32))


@dataclass(eq=False, slots=True)
class Sample:
    tokens: np.ndarray             # int32
    loss_mask: np.ndarray          # uint8, 1 exactly on sampled tokens
    rollout_log_probs: np.ndarray  # float32, 0.0 where loss_mask is 0
    response_length: int
    status: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # int32 [len(tokens), values per token]: SGLang's routed experts of each token fed to the model (its layers x
    # top_k expert ids, flattened), -1 where the engine reported none (the last token, turns without them).
    routed_experts: np.ndarray | None = None
    # Images (trajectory/images.py): `metadata["images"]` says per image its span of pad ids in `tokens`, content hash
    # and grid; these are what the model's vision tower takes, as transformers' image processor makes them for all of
    # them at once: float32 [patches of every image, channels x temporal patch x patch x patch] and int64 [images, 3].
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    # int32 [3, len(tokens)]: the multimodal RoPE positions (temporal, height, width) the model gives these tokens
    # (images.mrope_positions, as transformers' get_rope_index), so a trainer need not rebuild them from the ids.
    mrope_positions: np.ndarray | None = None
    # Sampling masks (trajectory/sampling_masks.py), CSR over `tokens`: the ids the sampler kept for token i are
    # `sampling_mask_ids[sampling_mask_offsets[i]:sampling_mask_offsets[i + 1]]`; a token the model did not sample
    # (prompt, tool output, template glue) has an empty row. `sampling_log_probs`: the engine's logprob of each
    # sampled token normalised over its row (0.0 on empty rows), beside `rollout_log_probs` (the full vocabulary's).
    sampling_mask_ids: np.ndarray | None = None      # int32
    sampling_mask_offsets: np.ndarray | None = None  # int64, len(tokens) + 1
    sampling_log_probs: np.ndarray | None = None     # float32, len(tokens)
    # Images as the agent sent them (the "bytes" form, trajectory/image_pixels.py): every image's encoded file, in
    # the order of `metadata["images"]`, concatenated; file k is `image_bytes[image_byte_offsets[k]:
    # image_byte_offsets[k + 1]]`. A trainer computes `pixel_values` from them (image_pixels.with_pixel_values).
    image_bytes: np.ndarray | None = None         # uint8
    image_byte_offsets: np.ndarray | None = None  # int64, images + 1

    def __post_init__(self) -> None:
        n = None
        for name, dtype in _ARRAYS:
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
                got = f"{array.dtype}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
                raise ValueError(f"sample.{name} must be a 1-D {np.dtype(dtype).name} array, got {got}")
            if n is not None and len(array) != n:
                raise ValueError(f"sample.{name} has {len(array)} items, tokens has {n}")
            n = len(array)
        if self.loss_mask.size and self.loss_mask.max() > 1:
            raise ValueError("sample.loss_mask must contain only 0 and 1")
        if isinstance(self.response_length, bool) or not isinstance(self.response_length, int) \
                or not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(f"sample.response_length {self.response_length!r} is not in [0, {len(self.tokens)}]")
        if self.status not in STATUSES:
            raise ValueError(f"sample.status {self.status!r} is not one of {STATUSES}")
        if not isinstance(self.metadata, dict):
            raise ValueError("sample.metadata must be a dict")
        r = self.routed_experts
        if r is not None and (not isinstance(r, np.ndarray) or r.dtype != np.int32 or r.ndim != 2
                              or len(r) != len(self.tokens)):
            raise ValueError("sample.routed_experts must be an int32 [len(tokens), k] array")
        p, g = self.pixel_values, self.image_grid_thw
        if (p is None) != (g is None) or (g is not None and (
                not isinstance(g, np.ndarray) or g.dtype != np.int64 or g.ndim != 2 or g.shape[1] != 3
                or not isinstance(p, np.ndarray) or p.dtype != np.float32 or p.ndim != 2
                or len(p) != int(g.prod(axis=1).sum()))):
            raise ValueError("sample.pixel_values (float32 [patches, dim]) and image_grid_thw (int64 [images, 3]) "
                             "come together, one row of pixels per patch of the grids")
        m = self.mrope_positions
        if m is not None and (not isinstance(m, np.ndarray) or m.dtype != np.int32 or m.shape != (3, len(self.tokens))):
            raise ValueError("sample.mrope_positions must be an int32 [3, len(tokens)] array")
        self._check_masks()
        data, offsets = self.image_bytes, self.image_byte_offsets
        if (data is None) != (offsets is None) or (offsets is not None and (
                not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1
                or not isinstance(offsets, np.ndarray) or offsets.dtype != np.int64 or offsets.ndim != 1
                or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(data) or (np.diff(offsets) < 0).any())):
            raise ValueError("sample.image_bytes (uint8) and image_byte_offsets (int64, rising from 0 to "
                             "len(image_bytes), one more than the images) come together")

    def _check_masks(self) -> None:
        arrays = [getattr(self, name) for name, _ in _MASK_ARRAYS]
        if all(a is None for a in arrays):
            return
        n = len(self.tokens)
        ids, offsets, logprobs = arrays
        shapes_ok = all(isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1
                        for a, (_, dtype) in zip(arrays, _MASK_ARRAYS, strict=True))
        if not shapes_ok or len(offsets) != n + 1 or len(logprobs) != n:
            raise ValueError("sample.sampling_mask_ids (int32), sampling_mask_offsets (int64, len(tokens) + 1) and "
                             "sampling_log_probs (float32, len(tokens)) come together")
        if offsets[0] != 0 or offsets[-1] != len(ids) or (np.diff(offsets) < 0).any():
            raise ValueError("sample.sampling_mask_offsets must rise from 0 to len(sampling_mask_ids)")

    @property
    def sampling_masks(self) -> SamplingMasks | None:
        """The CSR arrays as one value (None without masks)."""
        if self.sampling_mask_ids is None or self.sampling_mask_offsets is None or self.sampling_log_probs is None:
            return None
        return SamplingMasks(self.sampling_mask_ids, self.sampling_mask_offsets, self.sampling_log_probs)

    def set_masks(self, masks: SamplingMasks | None) -> None:
        if masks is not None:
            self.sampling_mask_ids, self.sampling_mask_offsets = masks.ids, masks.offsets
            self.sampling_log_probs = masks.logprobs
            self._check_masks()


def assemble_routed_experts(traj: LinearTrajectory) -> np.ndarray | None:
    """The records' routed experts (base64 int32 rows from `routed_experts_start`) on the trajectory's positions."""
    n = traj.num_tokens
    out: np.ndarray | None = None
    for record in traj.records:
        raw = bytes(record.routed_experts) if record.routed_experts else b""
        rows = record.routed_experts_rows
        if not raw or raw[:1] == b"[" or rows == 0:
            continue  # none, or a legacy JSON payload (kept in the record as it came)
        values = np.frombuffer(base64.b64decode(raw, validate=True), dtype=np.int32)
        if values.size % rows:
            raise ValueError(f"turn {record.rid}: {values.size} routed-expert values do not make {rows} rows")
        per_token = values.size // rows
        if out is None:
            out = np.full((n, per_token), -1, dtype=np.int32)
        elif out.shape[1] != per_token:
            raise ValueError(f"turn {record.rid}: {per_token} routed-expert values per token, earlier {out.shape[1]}")
        start = record.routed_experts_start
        end = min(n, start + rows)
        if end > start:
            out[start:end] = values.reshape(rows, per_token)[: end - start]
    return out


def weight_version_spans(traj: LinearTrajectory) -> list[list[Any]]:
    """[version, start, end) spans on the trajectory's positions of the weights that sampled each token."""
    spans: list[list[Any]] = []
    for record in traj.records:
        own = record.weight_versions or ((record.weight_version, 0, record.completion_len),)
        for version, a, b in own:
            if b > a:
                spans.append([version, record.prompt_len + a, record.prompt_len + b])
    return spans


def version_token_counts(spans: Sequence[Sequence[Any]], loss_mask: np.ndarray) -> dict[str, int]:
    """Sampled tokens per weight version (`metadata["weight_version_tokens"]`): the spans' tokens that lie inside
    the sample and have mask 1, by version (a version the engine did not name counts as "default")."""
    counts: dict[str, int] = {}
    n = len(loss_mask)
    for version, start, end in spans:
        lo, hi = max(0, int(start)), min(n, int(end))
        if hi > lo:
            key = INITIAL_VERSION if version is None else str(version)
            counts[key] = counts.get(key, 0) + int(loss_mask[lo:hi].sum())
    return {version: count for version, count in counts.items() if count}


def turn_adapter(record: TurnRecord) -> list[str | None] | None:
    """The LoRA adapter that sampled a turn as samples carry it: `[name, revision]`, None for the base model."""
    return None if record.adapter is None else [record.adapter, record.adapter_revision]


def _status(finish_reason: dict[str, Any]) -> str:
    return {"length": "truncated", "abort": "aborted"}.get(str(finish_reason.get("type")), "completed")


def build_turn_samples(traj: LinearTrajectory, max_seq_len: int | None = None) -> list[Sample]:
    """One sample per generated turn: that turn's prompt + completion, mask 1 only on its completion."""
    samples = []
    for k, record in enumerate(traj.records):
        ids, logprobs = traj.turn_tokens(k)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[record.prompt_len:] = 1
        masks = traj.turn_masks(k)
        if masks is not None:  # the prompt's rows are empty here: only this turn's completion is sampled in it
            masks = SamplingMasks.concat([SamplingMasks.from_rows([()] * record.prompt_len,
                                                                  [0.0] * record.prompt_len),
                                          masks.rows(record.prompt_len, len(ids))])
        sample = Sample(
            tokens=ids, loss_mask=mask, rollout_log_probs=logprobs, response_length=record.completion_len,
            status=_status(record.finish_reason),
            metadata={"turn": k, "rid": record.rid, "finish_reason": record.finish_reason,
                      "weight_version": record.weight_version, "prompt_len": record.prompt_len,
                      "cached_tokens": record.cached_tokens, "adapter": turn_adapter(record)},
        )
        own = record.weight_versions or ((record.weight_version, 0, record.completion_len),)
        sample.metadata["weight_version_tokens"] = version_token_counts(
            [(v, record.prompt_len + a, record.prompt_len + b) for v, a, b in own], mask)
        sample.set_masks(masks)
        if record.engine_session is not None:
            sample.metadata["engine_session"] = record.engine_session
        samples.append(truncate_sample(sample, max_seq_len) if max_seq_len is not None else sample)
    return samples


def sample_images(traj: LinearTrajectory) -> list[dict[str, Any]]:
    """Per image of the stored tokens, in order: its span [start, end) of pad ids, content hash and `image_grid_thw`
    (the trainer's model expands the same pads with the same grid)."""
    vision = traj.family.vision
    if vision is None or not traj.images:
        return []
    digests = prompt_images(traj.messages)
    spans = runs(traj.token_ids, vision.tokens.pad)
    if len(spans) != len(digests):
        raise ValueError(f"{len(spans)} image runs in the stored tokens for {len(digests)} images")
    return [{"span": [start, end], "digest": digest, "image_grid_thw": list(vision.grid(traj.images[digest]))}
            for (start, end), digest in zip(spans, digests, strict=True)]


def build_merged_sample(traj: LinearTrajectory, max_seq_len: int | None = None) -> Sample:
    """The last turn's tokens with every sampled token masked in; tool results and glue masked out."""
    if not traj.records:
        raise ValueError("the trajectory has no generated turn")
    records = traj.records
    sample = Sample(
        tokens=traj.token_ids.copy(), loss_mask=traj.loss_mask.copy(), rollout_log_probs=traj.logprobs.copy(),
        response_length=traj.num_tokens - records[0].prompt_len, status=_status(records[-1].finish_reason),
        metadata={"num_turns": len(records), "turns": [[r.prompt_len, r.completion_len] for r in records],
                  "rids": [r.rid for r in records], "weight_versions": [r.weight_version for r in records],
                  "rollbacks": sum(traj.rollbacks.values()), "rollbacks_by_reason": dict(traj.rollbacks),
                  "weight_version_spans": weight_version_spans(traj),
                  # per turn, the prompt tokens the engine's prefix cache served (cached / prompt: its hit rate)
                  "cached_tokens": [r.cached_tokens for r in records],
                  # per turn, the LoRA adapter [name, revision] that sampled it; None: the base model
                  "adapters": [turn_adapter(r) for r in records]},
        routed_experts=assemble_routed_experts(traj),
    )
    sample.metadata["weight_version_tokens"] = version_token_counts(sample.metadata["weight_version_spans"],
                                                                    sample.loss_mask)
    sample.set_masks(traj.sampling_masks)
    if any(r.engine_session is not None for r in records):  # per turn; "without": its whole history was prefilled
        sample.metadata["engine_sessions"] = [r.engine_session for r in records]
    if images := sample_images(traj):
        sample.metadata["images"] = images
        assert traj.family.vision is not None  # images exist only in a vision family's trajectory
        sample.mrope_positions = mrope_positions(len(sample.tokens), [i["span"] for i in images],
                                                 [i["image_grid_thw"] for i in images],
                                                 traj.family.vision.geometry.merge_size)
    return truncate_sample(sample, max_seq_len) if max_seq_len is not None else sample


def build_segment_samples(segments: Sequence[tuple[Segment, LinearTrajectory]],
                          max_seq_len: int | None = None, lineage: dict[str, Any] | None = None) -> list[Sample]:
    """One merged sample per segment that has a turn (SegmentSet.snapshot), in segment order.

    A forked session's samples each carry its `lineage` (trajectory/forks.py Lineage.info) under that key.

    A single-segment session gets exactly its merged sample; with several, each sample's metadata also says which
    segment it is and where that came from (`Segment.info`). Each loss mask covers exactly its own segment's
    sampled tokens, so over the samples they add up to every completion token the session kept.
    """
    samples = []
    for segment, traj in segments:
        if traj.records:
            sample = build_merged_sample(traj, max_seq_len)
            if len(segments) > 1:
                sample.metadata.update(segment.info())
            if lineage is not None:
                sample.metadata["lineage"] = dict(lineage)
            samples.append(sample)
    return samples


def truncate_sample(sample: Sample, max_seq_len: int) -> Sample:
    """Cut to `max_seq_len` keeping whole turns: the first overflowing turn's response is cut, and if
    nothing of it survives, its prompt goes too. The result is marked truncated."""
    if max_seq_len <= 0:
        raise ValueError("max_seq_len must be positive")
    n = len(sample.tokens)
    if n <= max_seq_len:
        return sample
    cut = max_seq_len
    if not sample.loss_mask[cut - 1]:  # the cut lands in a prompt: end at the last whole response instead
        sampled = np.flatnonzero(sample.loss_mask[:cut])
        if sampled.size:
            cut = int(sampled[-1]) + 1
    images = sample.metadata.get("images") or []
    for image in images:  # an image is kept whole or not at all: cut before a run the cut lands in
        if image["span"][0] < cut < image["span"][1]:
            cut = image["span"][0]
    kept = [image for image in images if image["span"][1] <= cut]
    prompt_len = n - sample.response_length
    metadata = {**sample.metadata, "truncated_from": n}
    if "weight_version_tokens" in metadata:  # of the tokens kept
        spans = metadata.get("weight_version_spans")
        if spans is None:
            spans = [(metadata.get("weight_version"), n - sample.response_length, n)]
        metadata["weight_version_tokens"] = version_token_counts(spans, sample.loss_mask[:cut])
    if images:
        metadata["images"] = kept
    pixels, grids = sample.pixel_values, sample.image_grid_thw
    if grids is not None and pixels is not None:
        grids = grids[:len(kept)].copy()
        pixels = pixels[:int(grids.prod(axis=1).sum())].copy()
    files, file_offsets = sample.image_bytes, sample.image_byte_offsets
    if files is not None and file_offsets is not None:
        file_offsets = file_offsets[:len(kept) + 1].copy()
        files = files[:int(file_offsets[-1])].copy()
    masks = sample.sampling_masks
    cut_sample = Sample(
        tokens=sample.tokens[:cut].copy(), loss_mask=sample.loss_mask[:cut].copy(),
        rollout_log_probs=sample.rollout_log_probs[:cut].copy(), response_length=max(0, cut - prompt_len),
        status="truncated", metadata=metadata,
        routed_experts=None if sample.routed_experts is None else sample.routed_experts[:cut].copy(),
        pixel_values=pixels, image_grid_thw=grids,
        mrope_positions=None if sample.mrope_positions is None else sample.mrope_positions[:, :cut].copy(),
        image_bytes=files, image_byte_offsets=file_offsets,
    )
    cut_sample.set_masks(None if masks is None else masks.rows(0, cut))
    return cut_sample


# -- JSON -------------------------------------------------------------------------------------------------
def samples_to_json(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    return [
        {"tokens": s.tokens.tolist(), "loss_mask": s.loss_mask.tolist(),
         "rollout_log_probs": s.rollout_log_probs.tolist(), "response_length": s.response_length,
         "status": s.status, "metadata": s.metadata,
         **({} if s.routed_experts is None else {"routed_experts": s.routed_experts.tolist()}),
         **({} if s.pixel_values is None or s.image_grid_thw is None else {
             "pixel_values": s.pixel_values.tolist(), "image_grid_thw": s.image_grid_thw.tolist()}),
         **({} if s.mrope_positions is None else {"mrope_positions": s.mrope_positions.tolist()}),
         **{name: getattr(s, name).tolist() for name, _ in _MASK_ARRAYS if getattr(s, name) is not None},
         **({} if s.image_bytes is None or s.image_byte_offsets is None else {
             "image_bytes": base64.b64encode(s.image_bytes.tobytes()).decode("ascii"),  # a string, not a list
             "image_byte_offsets": s.image_byte_offsets.tolist()})}
        for s in samples
    ]


def _json_array(i: int, name: str, values: Any, dtype: type) -> np.ndarray:
    kinds = (int,) if dtype is not np.float32 else (int, float)
    if not isinstance(values, list) or not all(type(v) in kinds for v in values):
        raise ValueError(f"samples[{i}].{name} must be a list of {'numbers' if len(kinds) > 1 else 'integers'}")
    array = np.asarray(values, dtype=np.float64 if dtype is np.float32 else np.int64)
    if dtype is not np.float32:
        info = np.iinfo(dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ValueError(f"samples[{i}].{name} has values outside the {np.dtype(dtype).name} range")
    return array.astype(dtype)


def _json_image_bytes(i: int, item: dict[str, Any]) -> dict[str, np.ndarray]:
    """`image_bytes` (a base64 string in JSON) and `image_byte_offsets`, when the sample carries them."""
    data, offsets = item.get("image_bytes"), item.get("image_byte_offsets")
    if data is None and offsets is None:
        return {}
    if not isinstance(data, str):
        raise ValueError(f"samples[{i}].image_bytes must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise ValueError(f"samples[{i}].image_bytes is not valid base64") from None
    return {"image_bytes": np.frombuffer(raw, np.uint8).copy(),
            "image_byte_offsets": _json_array(i, "image_byte_offsets", offsets, np.int64)}


def samples_from_json(data: Any) -> list[Sample]:
    if not isinstance(data, list):
        raise ValueError("samples must be a list")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"samples[{i}] must be an object")
        missing = {"tokens", "loss_mask", "rollout_log_probs", "response_length", "status"} - item.keys()
        if missing:
            raise ValueError(f"samples[{i}] is missing {sorted(missing)}")
        arrays = {name: _json_array(i, name, item[name], dtype) for name, dtype in _ARRAYS}
        routed = item.get("routed_experts")
        if routed is not None:
            try:
                routed = np.asarray(routed, dtype=np.int64)
            except (TypeError, ValueError):
                raise ValueError(f"samples[{i}].routed_experts must be a list of integer rows") from None
            if routed.ndim != 2 or (routed.size and (routed.min() < -(2**31) or routed.max() >= 2**31)):
                raise ValueError(f"samples[{i}].routed_experts must be rows of int32 values")
            routed = routed.astype(np.int32)
        pixels, grids = item.get("pixel_values"), item.get("image_grid_thw")
        if pixels is not None or grids is not None:
            try:
                pixels, grids = np.asarray(pixels, dtype=np.float32), np.asarray(grids, dtype=np.int64)
            except (TypeError, ValueError):
                raise ValueError(f"samples[{i}].pixel_values / image_grid_thw must be rows of numbers") from None
        positions = item.get("mrope_positions")
        if positions is not None:
            try:
                positions = np.asarray(positions, dtype=np.int64)
            except (TypeError, ValueError):
                raise ValueError(f"samples[{i}].mrope_positions must be three rows of integers") from None
            if positions.size and (positions.min() < 0 or positions.max() >= 2**31):
                raise ValueError(f"samples[{i}].mrope_positions must be int32 values")
            positions = positions.astype(np.int32)
        masks = {name: _json_array(i, name, item[name], dtype) for name, dtype in _MASK_ARRAYS
                 if item.get(name) is not None}
        files = _json_image_bytes(i, item)
        out.append(Sample(**arrays, response_length=item["response_length"], status=item["status"],
                          metadata=item.get("metadata") or {}, routed_experts=routed, pixel_values=pixels,
                          image_grid_thw=grids, mrope_positions=positions, **masks, **files))
    return out


# -- safetensors ------------------------------------------------------------------------------------------
def samples_to_safetensors(samples: Sequence[Sample]) -> bytes:
    """One payload: `{i}.tokens` int32, `{i}.loss_mask` uint8, `{i}.rollout_log_probs` float32 + JSON metadata."""
    tensors = {f"{i}.{name}": getattr(s, name) for i, s in enumerate(samples) for name, _ in _ARRAYS}
    for i, s in enumerate(samples):
        for name in _OPTIONAL:
            if (value := getattr(s, name)) is not None:
                tensors[f"{i}.{name}"] = value
    meta = [{"response_length": s.response_length, "status": s.status, "metadata": s.metadata} for s in samples]
    return st_save(tensors, metadata={"format": _FORMAT, "samples": json.dumps(meta, ensure_ascii=False)})


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    # safetensors.numpy.load drops the header metadata; the header is 8-byte little-endian length + JSON.
    if len(data) < 8:
        raise ValueError("safetensors payload is too short")
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    return header.get("__metadata__") or {}


def samples_from_safetensors(data: bytes) -> list[Sample]:
    try:
        tensors = st_load(data)
        meta = _safetensors_metadata(data)
    except Exception as exc:  # safetensors raises its own error types for corrupt payloads
        raise ValueError(f"invalid safetensors payload: {exc}") from exc
    if meta.get("format") != _FORMAT:
        raise ValueError(f"safetensors payload format is {meta.get('format')!r}, expected {_FORMAT!r}")
    entries = json.loads(meta.get("samples", "[]"))
    expected = {f"{i}.{name}" for i in range(len(entries)) for name, _ in _ARRAYS}
    expected |= {k for k in tensors if k.split(".", 1)[-1] in _OPTIONAL and k.split(".", 1)[0].isdigit()
                 and int(k.split(".", 1)[0]) < len(entries)}
    if set(tensors) != expected:
        raise ValueError(f"safetensors tensors {sorted(set(tensors) ^ expected)[:4]} do not match the metadata")
    return [
        Sample(**{name: tensors[f"{i}.{name}"] for name, _ in _ARRAYS}, response_length=entry["response_length"],
               status=entry["status"], metadata=entry.get("metadata") or {},
               routed_experts=tensors.get(f"{i}.routed_experts"), pixel_values=tensors.get(f"{i}.pixel_values"),
               image_grid_thw=tensors.get(f"{i}.image_grid_thw"), mrope_positions=tensors.get(f"{i}.mrope_positions"),
               sampling_mask_ids=tensors.get(f"{i}.sampling_mask_ids"),
               sampling_mask_offsets=tensors.get(f"{i}.sampling_mask_offsets"),
               sampling_log_probs=tensors.get(f"{i}.sampling_log_probs"),
               image_bytes=tensors.get(f"{i}.image_bytes"), image_byte_offsets=tensors.get(f"{i}.image_byte_offsets"))
        for i, entry in enumerate(entries)
    ]
