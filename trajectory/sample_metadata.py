"""The one reading of `Sample.metadata` (samples.py writes it): which turns a sample holds, and which weights sampled
each of its tokens. Every trainer-side module reads it through here, so the rules below hold for all of them.

What samples.py writes, and how it is read:
- a merged (or segment) sample: `turns` `[[prompt_len, completion_len], ...]`, `weight_versions` (the version each
  engine call ended on, one per turn) and `weight_version_spans` `[[version, start, end), ...]` on the sample's
  positions (SGLang's per-token `weight_versions` inside a call, so a reply cut by an update has two spans);
- a turn sample: `turn` (its index in the session), `prompt_len` and its one `weight_version`;
- every sample: `weight_version_tokens` `{version: sampled tokens}` (the counts `SampleMetadata.version_counts` reads
  off the spans, written for consumers that do not read spans);
- the LoRA adapter of each turn (issue 40): a merged sample's `adapters` (one per turn) and a turn sample's `adapter`,
  each `[name, revision]` or None for the base model; a sample without the key (written before adapters existed)
  was sampled by the base model;
- a forked session's samples: `lineage` (trajectory/forks.py Lineage.info): the parent session, the fork position in
  tokens (the sample's `tokens[:fork_position]` are its parent's, shared by its siblings), the fork's group, the
  tree's root and the depth; absent for a session that was not forked.

The rules:
- A sampled token (loss mask 1) takes the version of the span that holds it; a sample without spans has one
  `weight_version` for all of its sampled tokens. Unsampled tokens have none.
- A version the engine did not name (`None`, or no key at all) is SGLang's initial one, `"default"`
  (server_args.weight_version): an engine that never saw an update reports that, and it is step 0 for
  `parse_version`. Versions are strings, as SGLang sends them.
- A sampled token that no span covers is an error (ValueError), never silently filed under some version or left out
  of the staleness count: the trainer would train or check it against the wrong weights.
- A sampled token takes the adapter of the turn whose completion holds it (a turn keeps one adapter revision from
  its first engine request to its last); `BASE_MODEL` where no adapter sampled it, None where nothing was sampled.
- Spans and turns are read within the sample: a truncated sample (samples.truncate_sample keeps the metadata of the
  whole trajectory) holds only the turns whose completion starts inside it, cut at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .samples import INITIAL_VERSION as INITIAL_VERSION
from .samples import Sample


def parse_version(version: str) -> int:
    """A weight version as an integer step: SGLang's versions are strings; the initial one counts as step 0."""
    if version == INITIAL_VERSION:
        return 0
    try:
        return int(version)
    except (TypeError, ValueError):
        raise ValueError(f"weight version {version!r} is not an integer step: pass version_of= to map it") from None


def _version(value: Any) -> str:
    return INITIAL_VERSION if value is None else str(value)


@dataclass(frozen=True, slots=True)
class AdapterRevision:
    """The LoRA adapter (and its revision) that sampled a token; `BASE_MODEL` (both None) for the base weights."""

    name: str | None
    revision: str | None

    @property
    def is_base(self) -> bool:
        return self.name is None


BASE_MODEL = AdapterRevision(None, None)


def _adapter(value: Any) -> AdapterRevision:
    if value is None:
        return BASE_MODEL
    name, revision = value
    return AdapterRevision(str(name), None if revision is None else str(revision))


@dataclass(frozen=True, slots=True)
class GeneratedTurn:
    """One engine call's turn on the sample's positions: its prompt is `[0, start)`, its completion `[start, end)`
    (tool output after it is not part of it)."""

    index: int  # the turn's number in its session's trajectory
    start: int
    end: int
    weight_version: str  # the version the engine call ended on
    adapter: AdapterRevision = BASE_MODEL  # the LoRA adapter revision that sampled its completion


@dataclass(frozen=True, slots=True)
class SampleLineage:
    """Where a forked session's sample sits in its rollout tree (samples.py writes it as `lineage`)."""

    parent: str  # the parent session
    position: int  # tokens[:position] are the parent's (shared with the siblings), the rest the child's own
    turns: int  # the parent's turns the child began with
    group: str  # the siblings of one fork call
    root: str  # the tree's root session
    depth: int


@dataclass(frozen=True, slots=True)
class SampleMetadata:
    """What a trainer reads off a sample's metadata, typed and checked (`sample_metadata`)."""

    turns: tuple[GeneratedTurn, ...]
    token_versions: tuple[str | None, ...]  # per token: the weights that sampled it, None where the mask is 0
    generations: tuple[tuple[int, int], ...]  # `[start, end)` of each run of sampled tokens, in order
    image_spans: tuple[tuple[int, int], ...]  # `[start, end)` of each image's pad run, in order
    lineage: SampleLineage | None = None  # a forked session's place in its tree
    # per token: the LoRA adapter revision that sampled it (BASE_MODEL: the base weights), None where the mask is 0
    token_adapters: tuple[AdapterRevision | None, ...] = ()

    def adapters(self) -> set[AdapterRevision]:
        """Every adapter revision (BASE_MODEL included) that sampled a token of the sample."""
        return {a for a in self.token_adapters if a is not None}

    def version_ids(self, version_of: Callable[[str], int] = parse_version, fill: int = -1) -> np.ndarray:
        """int64 per token: `version_of` its version, `fill` where nothing was sampled."""
        out = np.full(len(self.token_versions), fill, dtype=np.int64)
        known: dict[str, int] = {}
        for i, version in enumerate(self.token_versions):
            if version is not None:
                if version not in known:
                    known[version] = version_of(version)
                out[i] = known[version]
        return out

    def version_range(self, version_of: Callable[[str], int] = parse_version) -> tuple[int | None, int | None]:
        """The oldest and newest integer version among the sampled tokens (None, None if there are none)."""
        versions = {version_of(v) for v in set(self.token_versions) if v is not None}
        return (min(versions), max(versions)) if versions else (None, None)

    def version_counts(self) -> dict[str, int]:
        """Sampled tokens per weight version, in order of first appearance (samples.py writes the same counts as
        `weight_version_tokens`)."""
        counts: dict[str, int] = {}
        for version in self.token_versions:
            if version is not None:
                counts[version] = counts.get(version, 0) + 1
        return counts

    def turn_at(self, position: int) -> int | None:
        """The index of the turn whose completion holds `position` (a turn sample: its own), or None."""
        for turn in self.turns:
            if turn.start <= position < turn.end:
                return turn.index
        return None

    def turn_versions(self) -> list[str]:
        """One version per generated turn, as the engine reported it at the call's end (slime's and miles'
        `weight_versions`)."""
        return [turn.weight_version for turn in self.turns]


def generation_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """`[start, end)` of each run of 1 in a loss mask, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _turns(meta: dict[str, Any], n: int, response_length: int) -> tuple[GeneratedTurn, ...]:
    if isinstance(meta.get("turn"), int):  # a turn sample: one turn, its completion to the end
        start = meta.get("prompt_len", n - response_length)
        return (GeneratedTurn(meta["turn"], min(int(start), n), n, _version(meta.get("weight_version")),
                              _adapter(meta.get("adapter"))),)
    lengths: Sequence[Sequence[int]] = meta.get("turns") or ()
    versions: Sequence[Any] = meta.get("weight_versions") or ()
    adapters: Sequence[Any] = meta.get("adapters") or ()
    turns = []
    for k, (prompt_len, completion_len) in enumerate(lengths):
        if prompt_len >= n:
            break
        version = versions[k] if k < len(versions) else meta.get("weight_version")
        adapter = _adapter(adapters[k]) if k < len(adapters) else BASE_MODEL
        turns.append(GeneratedTurn(k, int(prompt_len), min(n, int(prompt_len + completion_len)), _version(version),
                                   adapter))
    return tuple(turns)


def _token_adapters(sample: Sample, turns: Sequence[GeneratedTurn]) -> tuple[AdapterRevision | None, ...]:
    n = len(sample.tokens)
    sampled = sample.loss_mask.astype(bool)
    out = np.full(n, None, dtype=object)
    out[sampled] = BASE_MODEL  # a sample written before adapters existed: the base model sampled it
    for turn in turns:
        if not turn.adapter.is_base:
            out[turn.start:turn.end] = turn.adapter
    out[~sampled] = None
    return tuple(out.tolist())


def _token_versions(sample: Sample) -> tuple[str | None, ...]:
    meta, n = sample.metadata, len(sample.tokens)
    sampled = sample.loss_mask.astype(bool)
    spans: Sequence[Sequence[Any]] | None = meta.get("weight_version_spans")
    out = np.full(n, None, dtype=object)
    if spans is None:
        out[sampled] = _version(meta.get("weight_version"))
        return tuple(out.tolist())
    covered = np.zeros(n, dtype=bool)
    for version, start, end in spans:
        lo, hi = max(0, int(start)), min(n, int(end))
        if hi > lo:
            out[lo:hi] = _version(version)
            covered[lo:hi] = True
    out[~sampled] = None
    missing = np.flatnonzero(sampled & ~covered)
    if missing.size:
        raise ValueError(f"sampled tokens {missing[:5].tolist()} have no weight version in the sample's spans")
    return tuple(out.tolist())


def sample_metadata(sample: Sample) -> SampleMetadata:
    """The typed reading of `sample.metadata` (the rules in this module's docstring); ValueError where it breaks
    them."""
    meta, n = sample.metadata, len(sample.tokens)
    images = meta.get("images") or ()
    turns = _turns(meta, n, sample.response_length)
    return SampleMetadata(
        turns=turns,
        token_versions=_token_versions(sample),
        generations=tuple(generation_runs(sample.loss_mask)),
        image_spans=tuple((int(image["span"][0]), int(image["span"][1])) for image in images),
        lineage=_lineage(meta.get("lineage")),
        token_adapters=_token_adapters(sample, turns),
    )


def _lineage(raw: Any) -> SampleLineage | None:
    if raw is None:
        return None
    return SampleLineage(parent=str(raw["parent_session"]), position=int(raw["fork_position"]),
                         turns=int(raw["fork_turns"]), group=str(raw["group"]), root=str(raw["root_session"]),
                         depth=int(raw["depth"]))
