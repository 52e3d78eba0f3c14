"""`dedupe_prefixes`: a batch of forked samples with each tree's shared prefix stored once (Tree-GRPO's packing).

A fork's children begin with their parent's tokens (a GRPO group's prompt, a mid-episode branch's history): the
sample lineage (`trajectory.sample_metadata(...).lineage`) says where, `tokens[:position]` being the parent's. Padded
rows (`to_torch_batch`) carry that prefix once per child; a trainer that scores the batch as a tree computes it once.
Here the batch's tokens are packed so that every prefix a tree shares appears once, and each sample points into the
pack: `index[i]` is, for each of sample i's tokens, its place in `tokens`, so `tokens[index[i]]` is sample i's
`tokens` exactly. `parents` gives each packed token the one before it in its sequences (-1 for a first token) and
`positions` its position id: together the tree attention a packed forward pass needs (a token attends to its chain
of parents; `attention_mask()` spells it out for small batches). The per-token values a trainer computes once on the
pack (logprobs, entropies) are spread back to the samples with `gather`, where each sample's own loss mask, rollout
logprobs and advantage apply as before.

What is shared is checked, not assumed: a sample shares the longest run of its first `position` tokens that equals
an earlier sample of its tree (the same root session) token for token, so two samples share exactly the tokens they
both hold at the same places after the same tokens -- a wrong or missing lineage only costs sharing. A sample with
no lineage (a session that was not forked) shares nothing; it is a tree's root when its session id is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trajectory import Sample, sample_metadata


@dataclass(frozen=True)
class PrefixBatch:
    """A batch's tokens with each tree's shared prefixes once (see the module docstring)."""

    tokens: np.ndarray  # int32 [T]: the packed tokens
    parents: np.ndarray  # int64 [T]: the packed token before each one in its sequences, -1 for a sequence's first
    positions: np.ndarray  # int64 [T]: each packed token's position id (its index in every sample that holds it)
    index: list[np.ndarray]  # per sample, int64 [len(sample.tokens)]: where its tokens are in `tokens`
    shared: list[int]  # per sample, how many of its first tokens point into an earlier sample's

    @property
    def sample_tokens(self) -> int:
        """Tokens the samples hold together (what padded rows would carry, padding aside)."""
        return sum(len(i) for i in self.index)

    def gather(self, values: np.ndarray) -> list[np.ndarray]:
        """Per-packed-token `values` ([T, ...]) as one array per sample, in sample order."""
        if len(values) != len(self.tokens):
            raise ValueError(f"values cover {len(values)} tokens, the pack has {len(self.tokens)}")
        return [values[i] for i in self.index]

    def attention_mask(self) -> np.ndarray:
        """bool [T, T]: token t attends to u when u is t or one of its chain of parents (quadratic: for small batches
        and tests; a packed kernel takes `parents` or the per-sample `index` instead)."""
        size = len(self.tokens)
        mask = np.eye(size, dtype=bool)
        for t in range(size):  # parents come before their children in the pack
            parent = self.parents[t]
            if parent >= 0:
                mask[t] |= mask[parent]
        return mask


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    n = min(len(a), len(b), limit)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def dedupe_prefixes(samples: Sequence[Sample], session_ids: Sequence[str | None] | None = None) -> PrefixBatch:
    """Pack `samples` (in any order; parents' samples may be among them or not) with each tree's shared prefixes
    once. Samples are placed shallowest first, so a child points into its parent's sample when it is in the batch,
    else into a sibling's or cousin's that holds the same prefix. `session_ids`: the session of each sample
    (`EpisodeResult.session_id`); a tree's root session was not forked, so its samples carry no lineage, and only
    their session id makes them the tree's root that its children point into."""
    if session_ids is not None and len(session_ids) != len(samples):
        raise ValueError(f"{len(session_ids)} session ids for {len(samples)} samples")
    lineages = [sample_metadata(s).lineage for s in samples]
    depths = [0 if lineage is None else lineage.depth for lineage in lineages]
    order = sorted(range(len(samples)), key=depths.__getitem__)
    index: list[np.ndarray] = [np.empty(0, np.int64)] * len(samples)
    shared = [0] * len(samples)
    placed_by_root: dict[str, list[int]] = {}
    chunks: list[np.ndarray] = []
    parent_chunks: list[np.ndarray] = []
    position_chunks: list[np.ndarray] = []
    size = 0
    for i in order:
        sample, lineage = samples[i], lineages[i]
        tokens = np.asarray(sample.tokens)
        share, source = 0, -1
        if lineage is not None:
            for j in placed_by_root.get(lineage.root, ()):
                common = _common_prefix(tokens, np.asarray(samples[j].tokens), lineage.position)
                if common > share:
                    share, source = common, j
            placed_by_root.setdefault(lineage.root, []).append(i)
        elif session_ids is not None and (sid := session_ids[i]) is not None:
            placed_by_root.setdefault(sid, []).append(i)  # a root's sample: its children may point into it
        own = len(tokens) - share
        idx = np.empty(len(tokens), np.int64)
        if share:
            idx[:share] = index[source][:share]
        idx[share:] = np.arange(size, size + own)
        parents = np.arange(size - 1, size + own - 1, dtype=np.int64)
        if own:
            parents[0] = idx[share - 1] if share else -1
        chunks.append(tokens[share:].astype(np.int32))
        parent_chunks.append(parents)
        position_chunks.append(np.arange(share, len(tokens), dtype=np.int64))
        index[i], shared[i] = idx, share
        size += own
    empty = np.empty(0, np.int64)
    return PrefixBatch(tokens=np.concatenate(chunks) if chunks else np.empty(0, np.int32),
                       parents=np.concatenate(parent_chunks) if parent_chunks else empty,
                       positions=np.concatenate(position_chunks) if position_chunks else empty,
                       index=index, shared=shared)
