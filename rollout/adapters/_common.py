"""What every adapter reads off a `trajectory.Sample`, in one place: numpy only, no trainer.

A sample is one segment of one session (rollout.client `SessionClient.collect`): `tokens`, `loss_mask` and
`rollout_log_probs` all span the whole sequence, the first `len(tokens) - response_length` tokens are the first
turn's prompt, and the metadata of a merged sample says which weights sampled which tokens and where each generated
turn sits, read the one way `trajectory.sample_metadata` reads it. Each trainer wants some cut of that; the cuts are
here so that the seven adapters cannot disagree on an offset.

The agent contract every session-driving seam shares is miles' custom agent function: `async def agent(base_url,
prompt, request_kwargs, metadata) -> float | dict | None` (a reward, a dict of metadata with an optional "reward",
or nothing), run against one session of our server and followed by a collect of its samples.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout.client import SessionClient
from rollout.infrastructure import collect_after_failure
from trajectory import InfrastructureAbort, Sample, infrastructure_abort, sample_metadata
from trajectory.infrastructure import ABORTED
from trajectory.sample_metadata import AdapterRevision

Agent = Callable[..., Awaitable[Any]]

# OpenAI chat fields a trainer's sampling params may carry, after renaming SGLang's spellings.
_REQUEST_KEYS = frozenset({"temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "seed",
                           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"})
_RENAMES = {"max_new_tokens": "max_tokens", "sampling_seed": "seed"}
STOP_REASONS = {"completed": "stop", "truncated": "length", "aborted": "abort"}


def prompt_length(sample: Sample) -> int:
    """Tokens before the response: the first turn's prompt."""
    return len(sample.tokens) - sample.response_length


def response_part(sample: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The response's token ids, loss mask and rollout logprobs (tool output and glue inside it masked 0)."""
    p = prompt_length(sample)
    return sample.tokens[p:], sample.loss_mask[p:], sample.rollout_log_probs[p:]


def adapter_label(adapter: AdapterRevision) -> str:
    """A LoRA adapter revision as one string for a trainer's field: `NAME@REVISION` (revision 0 too, unlike the
    engine's own name for it), `NAME` for an adapter without revisions, "" for the base model (the session server's
    spelling of it in `lora_adapter`)."""
    if adapter.is_base:
        return ""
    return f"{adapter.name}@{adapter.revision}" if adapter.revision is not None else str(adapter.name)


def on_adapters(samples: Sequence[Sample]) -> bool:
    """Whether a LoRA adapter sampled any token of `samples` (a trainer field for the revision is added only then,
    so a base-model run's output keeps its shape)."""
    return any(not a.is_base for s in samples for a in sample_metadata(s).adapters())


def token_adapter_labels(sample: Sample, start: int = 0) -> list[str | None]:
    """Per token from `start`: `adapter_label` of the revision that sampled it, None where nothing was sampled (tool
    output, glue, the prompt), as `weight_versions` has it."""
    return [None if a is None else adapter_label(a) for a in sample_metadata(sample).token_adapters[start:]]


def turn_adapter_labels(sample: Sample) -> list[str]:
    """One `adapter_label` per generated turn, beside slime's and miles' one weight version per engine call."""
    return [adapter_label(turn.adapter) for turn in sample_metadata(sample).turns]


def response_sampling_masks(sample: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The response's sampling masks as slime's top-p replay takes them (`rollout_top_p_token_ids` /
    `rollout_top_p_token_offsets`): int32 ids and int32 offsets (response_length + 1), a response token the model did
    not sample (tool output, glue) a row of itself (miles' singleton support), and the behaviour logprobs: the
    engine's, over each sampled token's row. None for a sample without masks."""
    masks = sample.sampling_masks
    if masks is None:
        return None
    p = prompt_length(sample)
    part = masks.rows(p, len(sample.tokens))
    tokens = sample.tokens[p:]
    lengths = np.diff(part.offsets)
    single = lengths == 0
    ids = np.insert(part.ids, part.offsets[:-1][single], tokens[single])
    offsets = np.concatenate([[0], np.cumsum(np.maximum(lengths, 1))])
    return ids.astype(np.int32), offsets.astype(np.int32), part.logprobs


def response_support_rows(sample: Sample, width: int) -> np.ndarray | None:
    """The response's sampling masks as dense rows (SkyRL's `rollout_sample_support`): int32
    [response_length, width], each row's kept ids then -1, a token the model did not sample (tool output, glue) a
    row of -1 only. None for a sample without masks; a row wider than `width` is an error."""
    masks = sample.sampling_masks
    if masks is None:
        return None
    part = masks.rows(prompt_length(sample), len(sample.tokens))
    lengths = np.diff(part.offsets)
    if lengths.size and int(lengths.max()) > width:
        raise ValueError(f"a sampling-mask row holds {int(lengths.max())} ids, wider than {width}")
    rows = np.full((len(lengths), width), -1, dtype=np.int32)
    columns = np.arange(len(part.ids)) - np.repeat(part.offsets[:-1], lengths)
    rows[np.repeat(np.arange(len(lengths)), lengths), columns] = part.ids
    return rows


def widest_mask_row(samples: Sequence[Sample]) -> int:
    """The most ids any sampling-mask row of `samples` holds (0 without masks)."""
    widths = [int(np.diff(m.offsets).max(initial=0)) for s in samples if (m := s.sampling_masks) is not None]
    return max(widths, default=0)


def routed_experts(sample: Sample, layers: int | None) -> np.ndarray | None:
    """int32 [len(tokens), layers, top_k] (the engine's shape) or, without `layers`, the flat [len(tokens), k] rows.

    Rows are -1 where the engine reported none: the last token (never fed to the model) and turns without them.
    """
    rows = sample.routed_experts
    if rows is None:
        return None
    if layers is None:
        return rows
    if layers <= 0 or rows.shape[1] % layers:
        raise ValueError(f"{rows.shape[1]} routed-expert values per token do not split into {layers} layers")
    return rows.reshape(len(rows), layers, rows.shape[1] // layers)


def fed_routed_experts(sample: Sample, layers: int | None) -> np.ndarray | None:
    """The rows of the tokens fed to the model (all but the last), as SGLang returns them for a whole sequence:
    [len(tokens) - 1, layers, top_k]. A fed token without a row is an error (replay would route it nowhere)."""
    rows = routed_experts(sample, layers)
    if rows is None:
        return None
    fed = rows[: max(0, len(rows) - 1)]
    missing = np.flatnonzero((fed.reshape(len(fed), -1) < 0).any(axis=1))
    if missing.size:
        raise ValueError(f"tokens {missing[:5].tolist()} were fed to the model but have no routed experts")
    return fed


def reward_of(result: Any) -> float | None:
    """The reward an agent returned: a number, or a dict's "reward"."""
    if isinstance(result, bool):
        raise TypeError("an agent's reward must be a number, not a bool")
    if isinstance(result, (int, float)):
        return float(result)
    if isinstance(result, Mapping) and result.get("reward") is not None:
        return float(result["reward"])
    return None


def request_kwargs(sampling_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A trainer's sampling params as OpenAI chat request fields (SGLang's names renamed, the rest dropped)."""
    out: dict[str, Any] = {}
    for key, value in (sampling_params or {}).items():
        key = _RENAMES.get(key, key)
        if key in _REQUEST_KEYS and value is not None and key not in out:
            out[key] = value
    return out


def load_function(path: str | Agent) -> Agent:
    """`module.sub.function` -> the function (what trainers' `--custom-*-path` flags name); a callable as is."""
    if callable(path):
        return path
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not a module.function path")
    fn: Agent = getattr(importlib.import_module(module), name)
    return fn


@dataclass
class SessionEpisode:
    """One session run by an agent: its samples (one per segment), the reward and what the agent returned.

    `aborted`: the infrastructure ended the episode (trajectory/infrastructure.py): the server recorded it on the
    session, or the agent failed with an exception that reports it (`failure`). Its reward means nothing: each
    adapter hands it to its trainer as a dropped or masked rollout."""

    session_id: str
    samples: list[Sample]
    reward: float | None
    result: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    failure: BaseException | None = None

    @property
    def aborted(self) -> bool:
        return any(s.status == ABORTED for s in self.samples)

    @property
    def abort(self) -> InfrastructureAbort | None:
        """The recorded failure (the first sample's that has one)."""
        return next((a for s in self.samples if (a := infrastructure_abort(s)) is not None), None)


async def run_session(client: SessionClient, agent: Agent, *, prompt: Any = None,
                      request: Mapping[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                      max_seq_len: int | None = None, base_url_suffix: str = "/v1") -> SessionEpisode:
    """Open a session, run `agent` on its base URL, collect its samples, delete it (on every exit).

    An agent that fails because the infrastructure failed it (rollout/infrastructure.py) gives an episode of the
    samples the session holds, marked aborted, with no reward; any other exception propagates.

    `base_url_suffix`: "/v1" gives the agent the session's OpenAI base URL; "" gives miles' convention (the session
    root, to which a miles agent function appends /v1 itself).
    """
    meta = dict(metadata or {})
    async with client.session(metadata=meta or None) as sid:
        base = client.base_url(sid)
        if not base_url_suffix:
            base = base.removesuffix("/v1")
        try:
            result = await agent(base_url=base, prompt=prompt, request_kwargs=dict(request or {}), metadata=meta)
        except Exception as exc:
            aborted = await collect_after_failure(client, sid, exc, max_seq_len)
            if aborted is None:
                raise  # not the infrastructure's: the agent's own failure
            return SessionEpisode(sid, aborted, None, failure=exc)
        samples = await client.collect(sid, max_seq_len=max_seq_len)
    return SessionEpisode(sid, samples, reward_of(result), result,
                          dict(result) if isinstance(result, Mapping) else {})


def require_samples(samples: Sequence[Sample]) -> None:
    if not samples:
        raise ValueError("the session has no sample: the agent made no model call")
