"""`check_logprobs`: recompute every sampled token's logprob with the policy and report the rollout-vs-trainer
mismatch under the names RL teams already track.

A sample is worth training on only if the trainer, given the same tokens and the same weights, assigns each sampled
token the logprob the engine reported: the importance ratio of a policy-gradient step is built from both. This module
is the trainer's side of that contract (docs/design.md 6): one forward pass per sample (per weight version it spans),
the logits at position t-1 scored against token t in fp32, `log_softmax(logits / T)`, compared on the loss mask.

What SGLang 0.5.23 returns as a token's logprob (`srt/layers/sampler.py`, read from the released source):
- greedy (`temperature` 0, which SGLang turns into temperature 1 with top_k 1): `log_softmax(logits)`, the raw
  distribution;
- sampled: `log(softmax(logits / T))`, the temperature-scaled distribution, taken before top-k / top-p / min-p
  filtering (those change what may be drawn, not the returned logprob), unless the engine runs with
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, which returns `log_softmax(logits)` for every request;
- always after `logit_bias`, penalties and a grammar's vocabulary mask (applied to the logits before the sampler):
  tokens sampled under those carry logprobs of the modified distribution, which no trainer recomputes from weights.
So pass the request's `temperature` (0 or 1 for raw logprobs); samples do not record it.

Metrics (`LogprobCheckReport.metrics`), with the trainer's logprob `t` and the engine's `r` on each sampled token:
- verl's rollout-correction family (`rollout_corr/...`, verl's `compute_offpolicy_metrics`): `kl` = mean(r - t) over
  tokens, `k3_kl` = mean(exp(t - r) - (t - r) - 1), `training_ppl` / `rollout_ppl` (batch mean of each sample's
  perplexity) and their `_log_ppl`, `log_ppl_diff` (batch mean of each sample's mean(r) - mean(t)) with
  `log_ppl_abs_diff`, `log_ppl_diff_max`, `log_ppl_diff_min`, `ppl_ratio`, `chi2_token` = mean(exp(t - r)^2) - 1 and
  `chi2_seq` (per sample, the squared product of ratios, log-ratio sums clamped to +-20 as verl clamps them);
- verl's debug metrics on probabilities: `training/rollout_probs_diff_{mean,max,std}` = |exp(t) - exp(r)| and
  `training/rollout_actor_probs_pearson_corr`;
- miles' `train_rollout_logprob_abs_diff`: the mean over samples of each sample's mean |t - r| (miles logs it as
  `train/train_rollout_logprob_abs_diff` and its CI gates on it);
- ours, the bar of docs/design.md 6 (fp32, within 1e-3): `rollout_check/logprob_abs_diff_max` and `_mean` over tokens,
  token / sample counts, and for MoE `rollout_check/routing_mismatch_fraction`: the (token, layer) rows where the
  trainer's router picks another expert set than the engine recorded; `rollout_check/switched_tokens`, the tokens
  sampled after their turn's weights changed (an update inside the request: paused in place, the request keeps the
  KV its prefix got from the old weights, so no single checkpoint reproduces them), and
  `rollout_check/logprob_abs_diff_max_unswitched`, the max over the others (`ok(switched=False)` gates on it).

MoE routing replay: a sample with `routed_experts` (SGLang's `[tokens, layers * top_k]` ids) is recomputed with each
layer's top-k choice replaced by the recorded experts, as the engine routed them (miles' R3). The expert weights
stay the trainer router's softmax over all experts, gathered at the replayed ids and renormalised when the model
says `norm_topk_prob` (what SGLang's Qwen3-MoE `TopK(renormalize=norm_topk_prob)` computes). Rows the engine did not
record (the last token, which no forward pass routed) keep the router's own choice: no sampled token's logprob
depends on them. The routers are found by shape (transformers' `*TopKRouter` modules: `top_k`, `num_experts`,
returning logits, scores and indices), so nothing here imports transformers.

Sampling masks (top-k / top-p / min-p, trajectory/sampling_masks.py): the engine then sampled each token from its
kept set renormalised, and its sampling logprob (`Sample.sampling_log_probs`) is the full logprob minus the
log-sum-exp over the row. With rows, the check also recomputes that: `log_softmax(logits / T)` renormalised over
each sampled token's row, compared with the engine's sampling logprob (`rollout_check/support_logprob_abs_diff_max`
and `_mean`, gated by `ok_support`), and reports beside it how far the trainer's full-vocabulary logprob is from the
engine's sampling logprob (`rollout_check/unmasked_logprob_abs_diff_max` and `_mean`): the bias of a ratio that
ignores the rows.

Weight versions: which weights sampled each token is read by `trajectory.sample_metadata` (a merged sample's spans, a
turn sample's one version; a sampled token without one is a ValueError). With a callable policy, tokens of version v
are scored by `policy(v)` (v as the engine reported it: SGLang's versions are strings, "default" until the trainer
names one in `/update_weights_from_disk`, and where the engine named none), one forward pass per sample and version.

LoRA adapters (issue 40): which adapter revision sampled each token is read by `trajectory.sample_metadata` too (each
turn's `[name, revision]`, the base model where none). With `adapters` (`AdapterRevision -> its directory`, a
callable or a mapping), a token sampled under an adapter is scored by its weight version's model with that revision
merged in (rollout/lora_merge.py: `W += B @ A * alpha / r`, one merged copy per version and revision); a sample with
adapter tokens and no `adapters` is a ValueError, never silently scored by the base model.

torch is imported here, by rollout.lora_merge and by rollout.torch_batch only: `import rollout` stays torch-free.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from trajectory import Sample, SampleMetadata, sample_metadata
from trajectory.sample_metadata import AdapterRevision

# Where each LoRA adapter revision's files are: a callable or a mapping (AdapterRevision -> directory).
AdapterDirs = Callable[[AdapterRevision], Any] | Mapping[AdapterRevision, Any]

# A policy: the model itself, or weight version -> the model holding those weights.
Policy = torch.nn.Module | Callable[[Any], torch.nn.Module]

# verl clamps log-ratios (token and sequence) to +-20 before exponentiating them for chi-square.
SAFETY_BOUND = 20.0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class TokenMismatch:
    """One sampled token where the trainer and the engine disagree, located for a human."""

    sample: int                 # index into the checked samples
    position: int               # position of the token in the sample
    token_id: int
    rollout_log_prob: float     # the engine's
    trainer_log_prob: float     # recomputed
    abs_diff: float
    turn: int | None            # the trajectory turn that sampled it (None when the sample does not say)
    weight_version: str | None  # the weights that sampled it, as the engine reported them
    switched: bool = False      # sampled after its turn's weights changed (an update inside the request)


@dataclass(slots=True)
class SampleCheck:
    """One sample's comparison; `trainer_log_probs` has the sample's length (0.0 where the loss mask is 0), so a
    trainer can reuse it as its recomputed old logprobs."""

    index: int
    num_tokens: int                 # sampled tokens compared
    trainer_log_probs: np.ndarray   # float32 [len(tokens)]
    abs_diff_mean: float
    abs_diff_max: float
    kl: float                       # mean(r - t)
    k3_kl: float                    # mean(exp(t - r) - (t - r) - 1)
    log_ppl_diff: float             # mean(r) - mean(t)
    replayed: bool                  # routing replayed from the sample's routed experts
    routing_rows: int               # (token, layer) rows compared with the engine's routing
    routing_mismatched: int         # of those, where the trainer's router chose other experts
    weight_versions: tuple[str, ...]
    switched_tokens: int = 0        # sampled after their turn's weights changed (see `check_logprobs`)


@dataclass(slots=True)
class LogprobCheckReport:
    metrics: dict[str, float]
    per_sample: list[SampleCheck]
    worst: list[TokenMismatch]

    @property
    def max_abs_diff(self) -> float:
        return self.metrics.get("rollout_check/logprob_abs_diff_max", 0.0)

    def ok(self, atol: float = 1e-3, *, switched: bool = True) -> bool:
        """Every sampled token within `atol` of the engine's logprob (the fp32 bar of docs/design.md 6); with
        `switched=False`, every token but those sampled after their turn's weights changed."""
        if switched:
            return self.max_abs_diff <= atol
        return self.metrics.get("rollout_check/logprob_abs_diff_max_unswitched", 0.0) <= atol

    def ok_support(self, atol: float = 1e-3) -> bool:
        """Every sampled token with a sampling-mask row: the trainer's logprob renormalised over the row within `atol`
        of the engine's sampling logprob (False when no token had a row)."""
        m = self.metrics
        return bool(m.get("rollout_check/support_tokens")) and m["rollout_check/support_logprob_abs_diff_max"] <= atol

    def format(self) -> str:
        """A few lines for a log: the headline metrics and the worst tokens."""
        m = self.metrics
        lines = [
            f"logprob check: {int(m.get('rollout_check/samples', 0))} samples, "
            f"{int(m.get('rollout_check/tokens', 0))} sampled tokens, "
            f"max |diff| {self.max_abs_diff:.3g}, mean {m.get('rollout_check/logprob_abs_diff_mean', 0.0):.3g}, "
            f"k3_kl {m.get('rollout_corr/k3_kl', 0.0):.3g}"
        ]
        if m.get("rollout_check/switched_tokens"):
            lines[0] += (f", {int(m['rollout_check/switched_tokens'])} tokens sampled after their turn's weights "
                         f"changed (max |diff| of the others {m['rollout_check/logprob_abs_diff_max_unswitched']:.3g})")
        if m.get("rollout_check/support_tokens"):
            lines[0] += (f", over the sampling masks ({int(m['rollout_check/support_tokens'])} tokens) max |diff| "
                         f"{m['rollout_check/support_logprob_abs_diff_max']:.3g} (full vocabulary: "
                         f"{m['rollout_check/unmasked_logprob_abs_diff_max']:.3g})")
        if "rollout_check/routing_mismatch_fraction" in m:
            lines[0] += (f", replayed {int(m['rollout_check/replayed_samples'])} samples, routing mismatch "
                         f"{m['rollout_check/routing_mismatch_fraction']:.2%}")
        for w in self.worst:
            lines.append(f"  sample {w.sample} pos {w.position} id {w.token_id} turn {w.turn} "
                         f"version {w.weight_version!r}: engine {w.rollout_log_prob:.6f} "
                         f"trainer {w.trainer_log_prob:.6f} |diff| {w.abs_diff:.3g}")
        return "\n".join(lines)


def check_logprobs(samples: Sequence[Sample], policy: Policy, *, replay_routing: bool = True, worst: int = 10,
                   temperature: float = 1.0, adapters: AdapterDirs | None = None) -> LogprobCheckReport:
    """Recompute every sampled token of `samples` with `policy` and compare with the rollout logprobs.

    `policy` is a torch module (a transformers causal LM, or any module whose output is logits or has `.logits`)
    or a callable `version -> module` (tokens sampled under weight version v are scored by `policy(v)`). With
    `replay_routing`, samples that carry routed experts are recomputed with the engine's routing (MoE); without, with
    the trainer's own. `temperature` is the sampling temperature of the requests (0 counts as 1, as in SGLang).
    `worst` tokens by absolute difference are listed in the report. `adapters`: where each LoRA adapter revision the
    samples name is (see the module docstring).
    """
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    scale = temperature if temperature > 0 else 1.0
    resolve = _with_adapters(_resolver(policy), adapters)
    checks: list[SampleCheck] = []
    rollout_all: list[np.ndarray] = []
    trainer_all: list[np.ndarray] = []
    where: list[tuple[int, np.ndarray]] = []
    flags: list[np.ndarray] = []
    support_diffs: list[np.ndarray] = []  # per sample: |support recompute - engine's sampling logprob| on rows
    unmasked_diffs: list[np.ndarray] = []  # and |full-vocabulary recompute - engine's sampling logprob|
    replays: dict[int, _RoutingReplay] = {}
    try:
        for index, sample in enumerate(samples):
            positions = np.flatnonzero(sample.loss_mask)
            positions = positions[positions > 0]  # position 0 has no context to predict it from
            meta = sample_metadata(sample)
            versions = _versions_of(meta, positions)
            switched = _switched(meta, positions, versions)
            scored_by = [(v, meta.token_adapters[p]) for v, p in zip(versions, positions.tolist(), strict=True)]
            trainer = np.zeros(len(sample.tokens), dtype=np.float32)
            support = np.full(len(sample.tokens), np.nan, dtype=np.float32)
            rows = sample.routed_experts
            routing_rows = routing_mismatched = 0
            replayed = False
            for model, chosen in _by_model(resolve, positions, scored_by):
                replay = None
                if rows is not None:
                    replay = replays.get(id(model))
                    if replay is None:
                        replay = replays[id(model)] = _RoutingReplay(model)
                    if not replay.routers:
                        if replay_routing:
                            raise ValueError(f"sample {index} has routed experts but the policy has no top-k router "
                                             "to replay them into")
                        replay = None
                with _routing(replay, rows, replay_routing):
                    trainer[chosen], support[chosen] = _score(model, sample.tokens, chosen, scale, sample)
                if replay is not None:
                    routing_rows += replay.compared
                    routing_mismatched += replay.mismatched
                    replayed = replay_routing
            r = sample.rollout_log_probs[positions].astype(np.float64)
            t = trainer[positions].astype(np.float64)
            checks.append(_sample_check(index, trainer, r, t, replayed, routing_rows, routing_mismatched,
                                        tuple(dict.fromkeys(versions)), int(switched.sum())))
            if (masks := sample.sampling_masks) is not None:
                on = positions[np.diff(masks.offsets)[positions] > 0]
                engine = masks.logprobs[on].astype(np.float64)
                support_diffs.append(np.abs(support[on].astype(np.float64) - engine))
                unmasked_diffs.append(np.abs(trainer[on].astype(np.float64) - engine))
            rollout_all.append(r)
            trainer_all.append(t)
            where.append((index, positions))
            flags.append(switched)
    finally:
        for replay in replays.values():
            replay.close()
    metrics = _metrics(checks, rollout_all, trainer_all, flags, any(s.routed_experts is not None for s in samples))
    metrics.update(_support_metrics(support_diffs, unmasked_diffs))
    return LogprobCheckReport(metrics, checks, _worst(samples, where, rollout_all, trainer_all, flags, worst))


# -- which weights scored which token ---------------------------------------------------------------------------
def _resolver(policy: Policy) -> Callable[[Any], torch.nn.Module]:
    if isinstance(policy, torch.nn.Module):
        return lambda _version: policy
    if callable(policy):
        return policy
    raise TypeError(f"policy must be a torch module or a callable version -> module, got {type(policy).__name__}")


def _with_adapters(resolve: Callable[[Any], torch.nn.Module], adapters: AdapterDirs | None
                   ) -> Callable[[Any], torch.nn.Module]:
    """`(version, adapter revision) -> module`: the version's model, with the revision merged in (once per pair)."""
    merged: dict[tuple[int, AdapterRevision], torch.nn.Module] = {}

    def scorer(key: tuple[Any, AdapterRevision | None]) -> torch.nn.Module:
        version, adapter = key
        base = resolve(version)
        if adapter is None or adapter.is_base:
            return base
        if adapters is None:
            raise ValueError(f"tokens were sampled by LoRA adapter {adapter.name!r} revision {adapter.revision!r}: "
                             "pass adapters= (revision -> its directory) to score them with it")
        found = merged.get((id(base), adapter))
        if found is None:
            from rollout.lora_merge import merge_adapter

            where = adapters[adapter] if isinstance(adapters, Mapping) else adapters(adapter)
            found = merged[(id(base), adapter)] = merge_adapter(base, where)
        return found

    return scorer


def _versions_of(meta: SampleMetadata, positions: np.ndarray) -> list[str]:
    """The weight version of each of `positions` (sampled tokens, so each has one)."""
    return [cast(str, meta.token_versions[p]) for p in positions.tolist()]


def _switched(meta: SampleMetadata, positions: np.ndarray, versions: list[str]) -> np.ndarray:
    """Which of `positions` were sampled after their turn's weights changed: an update inside the request (SGLang's
    `weight_versions` spans). Paused in place, the request keeps the KV its prefix got from the old weights, so no
    single checkpoint reproduces these tokens; aborted and re-prefilled after a cache flush, they are exact."""
    out = np.zeros(len(positions), dtype=bool)
    for turn in meta.turns:
        lo, hi = np.searchsorted(positions, [turn.start, turn.end])
        out[lo:hi] = [v != versions[lo] for v in versions[lo:hi]] if hi > lo else []
    return out


def _by_model(resolve: Callable[[Any], torch.nn.Module], positions: np.ndarray, versions: list[Any]
              ) -> Iterator[tuple[torch.nn.Module, np.ndarray]]:
    """(model, positions it scores): versions that resolve to the same module share one forward pass."""
    groups: dict[int, tuple[torch.nn.Module, list[int]]] = {}
    models: dict[Any, torch.nn.Module] = {}
    for i, version in enumerate(versions):
        key = (type(version).__name__, version)
        model = models.get(key)
        if model is None:
            model = models[key] = resolve(version)
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"policy({version!r}) returned {type(model).__name__}, not a torch module")
        groups.setdefault(id(model), (model, []))[1].append(i)
    for model, picks in groups.values():
        yield model, positions[picks]


# -- the forward pass -----------------------------------------------------------------------------------------
def _images(sample: Sample | None, end: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The vision inputs of a sample's images that lie inside its first `end` tokens (trajectory/samples.py:
    `metadata["images"]` spans, `pixel_values`, `image_grid_thw`), as a Qwen-VL model's forward takes them, with
    `mm_token_type_ids` (1 over each image's run); it rebuilds the mRoPE positions from those and the grids, as the
    engine did. {} for a sample without images."""
    if sample is None or sample.pixel_values is None or sample.image_grid_thw is None:
        return {}
    spans = sample_metadata(sample).image_spans
    keep = sum(1 for _, stop in spans if stop <= end)
    if not keep:
        return {}
    grids = sample.image_grid_thw[:keep]
    rows = int(grids.prod(axis=1).sum())
    kinds = torch.zeros((1, end), dtype=torch.int32, device=device)  # text 0, image 1 (transformers' mRoPE input)
    for start, stop in spans[:keep]:
        kinds[0, start:stop] = 1
    return {"pixel_values": torch.as_tensor(sample.pixel_values[:rows], device=device, dtype=dtype),
            "image_grid_thw": torch.as_tensor(grids, device=device), "mm_token_type_ids": kinds}


def _score(model: torch.nn.Module, tokens: np.ndarray, positions: np.ndarray, temperature: float,
           sample: Sample | None = None) -> tuple[np.ndarray, np.ndarray]:
    """log p(tokens[p] | tokens[:p]) for each p in `positions`, in fp32, from one forward pass over the sample (with
    its images, when it has some); and the same renormalised over p's sampling-mask row (NaN without one)."""
    if not len(positions):
        return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.float32)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    end = int(positions.max())  # nothing after the last scored token's context is needed
    ids = torch.as_tensor(tokens[:end].astype(np.int64), device=device).unsqueeze(0)
    before = torch.as_tensor(positions - 1, dtype=torch.long, device=device)
    kwargs: dict[str, Any] = _images(sample, end, device, parameter.dtype if parameter is not None else torch.float32)
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = before  # only the rows scored: a full [len, vocab] block can be GBs
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, **kwargs)
            logits = out.logits if hasattr(out, "logits") else out
            logits = logits[0] if "logits_to_keep" in kwargs else logits[0, before]
            logits = logits.float() / temperature
            targets = torch.as_tensor(tokens[positions].astype(np.int64), device=device)
            chosen = logits.gather(-1, targets[:, None])[:, 0]
            picked = chosen - torch.logsumexp(logits, dim=-1)
            renormalised = _over_rows(logits, chosen, sample, positions)
    finally:
        model.train(was_training)
    scored: np.ndarray = picked.cpu().numpy().astype(np.float32)
    return scored, renormalised


def _over_rows(logits: torch.Tensor, chosen: torch.Tensor, sample: Sample | None, positions: np.ndarray
               ) -> np.ndarray:
    """The chosen logits renormalised over each position's sampling-mask row: chosen - logsumexp(logits[row]), NaN
    where the sample has no row."""
    out = np.full(len(positions), np.nan, dtype=np.float32)
    masks = sample.sampling_masks if sample is not None else None
    if masks is None:
        return out
    lengths = np.diff(masks.offsets)[positions]
    have = np.flatnonzero(lengths > 0)
    if not len(have):
        return out
    width = int(lengths[have].max())
    ids = np.zeros((len(have), width), dtype=np.int64)
    valid = np.zeros((len(have), width), dtype=bool)
    for k, i in enumerate(have.tolist()):
        row = masks.row(int(positions[i]))
        ids[k, :len(row)], valid[k, :len(row)] = row, True
    rows = torch.as_tensor(ids, device=logits.device)
    kept = logits[torch.as_tensor(have, device=logits.device)].gather(-1, rows)
    kept = kept.masked_fill(~torch.as_tensor(valid, device=logits.device), float("-inf"))
    values = chosen[torch.as_tensor(have, device=logits.device)] - torch.logsumexp(kept, dim=-1)
    out[have] = values.cpu().numpy()
    return out


def _accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# -- MoE routing replay ---------------------------------------------------------------------------------------
class _RoutingReplay:
    """Forward hooks on a model's top-k routers that compare (and, when asked, replace) each layer's choice of
    experts with the engine's recorded one for the sample being scored."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers: list[tuple[int, int, torch.nn.Module]] = []  # (decoder layer, router ordinal, module)
        for name, module in model.named_modules():
            if (type(module).__name__.endswith("Router") and isinstance(getattr(module, "top_k", None), int)
                    and isinstance(getattr(module, "num_experts", None), int)):
                match = _LAYER.search(name + ".")
                layer = int(match.group(1)) if match else len(self.routers)
                self.routers.append((layer, len(self.routers), module))
        config = getattr(model, "config", None)
        self.num_layers = getattr(config, "num_hidden_layers", None)
        self.rows: torch.Tensor | None = None  # [tokens, layers, top_k] int64, -1 where not recorded
        self.replace = False
        self.by_layer = True  # the rows' layer axis is the decoder layer (SGLang's), else the router's ordinal
        self.compared = self.mismatched = 0
        self.handles = [module.register_forward_hook(self._hook(layer, ordinal))
                        for layer, ordinal, module in self.routers]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def load(self, rows: np.ndarray, replace: bool) -> None:
        top_k: int = getattr(self.routers[0][2], "top_k")  # noqa: B009 (a module attribute torch types as Tensor)
        if rows.shape[1] % top_k:
            raise ValueError(f"{rows.shape[1]} routed-expert values per token are not layers x top_k {top_k}")
        layers = rows.shape[1] // top_k
        if layers not in (self.num_layers, len(self.routers)):
            raise ValueError(f"routed experts cover {layers} layers; the policy has {self.num_layers} layers and "
                             f"{len(self.routers)} routers")
        self.by_layer = layers == self.num_layers
        self.rows = torch.from_numpy(rows.astype(np.int64)).view(len(rows), layers, top_k)
        self.replace = replace
        self.compared = self.mismatched = 0

    def unload(self) -> None:
        self.rows = None

    def _hook(self, layer: int, ordinal: int) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self.rows is None:
                return None
            logits, scores, indices = output
            recorded = self.rows[: len(indices), layer if self.by_layer else ordinal].to(indices.device)
            known = (recorded >= 0).all(dim=-1)
            differs = (recorded.sort(dim=-1).values != indices.sort(dim=-1).values).any(dim=-1) & known
            self.compared += int(known.sum())
            self.mismatched += int(differs.sum())
            if not self.replace:
                return None
            chosen = torch.where(known[:, None], recorded, indices)
            probs = torch.softmax(logits.float(), dim=-1)
            weights = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), chosen

        return hook


@contextmanager
def _routing(replay: _RoutingReplay | None, rows: np.ndarray | None, replace: bool) -> Iterator[None]:
    if replay is None or rows is None:
        yield
        return
    replay.load(rows, replace)
    try:
        yield
    finally:
        replay.unload()


# -- metrics --------------------------------------------------------------------------------------------------
def _sample_check(index: int, trainer: np.ndarray, r: np.ndarray, t: np.ndarray, replayed: bool, routing_rows: int,
                  routing_mismatched: int, versions: tuple[Any, ...], switched: int) -> SampleCheck:
    diff = np.abs(t - r)
    n = len(diff)
    log_ratio = t - r
    return SampleCheck(
        index=index, num_tokens=n, trainer_log_probs=trainer,
        abs_diff_mean=float(diff.mean()) if n else 0.0, abs_diff_max=float(diff.max()) if n else 0.0,
        kl=float((r - t).mean()) if n else 0.0,
        k3_kl=float((np.exp(log_ratio) - log_ratio - 1).mean()) if n else 0.0,
        log_ppl_diff=float(r.mean() - t.mean()) if n else 0.0,
        replayed=replayed, routing_rows=routing_rows, routing_mismatched=routing_mismatched,
        weight_versions=versions, switched_tokens=switched,
    )


def _metrics(checks: list[SampleCheck], rollout: list[np.ndarray], trainer: list[np.ndarray],
             flags: list[np.ndarray], moe: bool) -> dict[str, float]:
    metrics: dict[str, float] = {
        "rollout_check/samples": float(len(checks)),
        "rollout_check/tokens": float(sum(c.num_tokens for c in checks)),
        "rollout_check/replayed_samples": float(sum(c.replayed for c in checks)),
        "rollout_check/switched_tokens": float(sum(c.switched_tokens for c in checks)),
    }
    rows = sum(c.routing_rows for c in checks)
    if moe and rows:
        metrics["rollout_check/routing_mismatch_fraction"] = sum(c.routing_mismatched for c in checks) / rows
    seqs = [(r, t) for r, t in zip(rollout, trainer, strict=True) if len(r)]
    if not seqs:
        metrics.update({"rollout_check/logprob_abs_diff_max": 0.0, "rollout_check/logprob_abs_diff_mean": 0.0,
                        "rollout_check/logprob_abs_diff_max_unswitched": 0.0})
        return metrics
    r = np.concatenate([s[0] for s in seqs])
    t = np.concatenate([s[1] for s in seqs])
    diff = np.abs(t - r)
    unswitched = diff[~np.concatenate([f for f, s in zip(flags, rollout, strict=True) if len(s)])]
    log_ratio = t - r
    mean_r = np.array([s[0].mean() for s in seqs])
    mean_t = np.array([s[1].mean() for s in seqs])
    log_ppl_diff = mean_r - mean_t
    seq_log_ratio = np.clip([(s[1] - s[0]).sum() for s in seqs], -SAFETY_BOUND, SAFETY_BOUND)
    probs_diff = np.abs(np.exp(t) - np.exp(r))
    metrics.update({
        "rollout_check/logprob_abs_diff_max": float(diff.max()),
        "rollout_check/logprob_abs_diff_mean": float(diff.mean()),
        "rollout_check/logprob_abs_diff_max_unswitched": float(unswitched.max()) if len(unswitched) else 0.0,
        "train_rollout_logprob_abs_diff": float(np.mean([np.abs(s[1] - s[0]).mean() for s in seqs])),
        "rollout_corr/training_ppl": float(np.exp(-mean_t).mean()),
        "rollout_corr/training_log_ppl": float((-mean_t).mean()),
        "rollout_corr/rollout_ppl": float(np.exp(-mean_r).mean()),
        "rollout_corr/rollout_log_ppl": float((-mean_r).mean()),
        "rollout_corr/kl": float((r - t).mean()),
        "rollout_corr/k3_kl": float((np.exp(log_ratio) - log_ratio - 1).mean()),
        "rollout_corr/log_ppl_diff": float(log_ppl_diff.mean()),
        "rollout_corr/log_ppl_abs_diff": float(np.abs(log_ppl_diff).mean()),
        "rollout_corr/log_ppl_diff_max": float(log_ppl_diff.max()),
        "rollout_corr/log_ppl_diff_min": float(log_ppl_diff.min()),
        "rollout_corr/ppl_ratio": float(np.exp(log_ppl_diff).mean()),
        "rollout_corr/chi2_token": float(np.exp(2 * np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)).mean() - 1),
        "rollout_corr/chi2_seq": float(np.exp(2 * seq_log_ratio).mean() - 1),
        "training/rollout_probs_diff_mean": float(probs_diff.mean()),
        "training/rollout_probs_diff_max": float(probs_diff.max()),
        "training/rollout_probs_diff_std": float(probs_diff.std(ddof=1)) if len(probs_diff) > 1 else 0.0,
    })
    p_t, p_r = np.exp(t), np.exp(r)
    if len(r) > 1 and p_t.std() > 0 and p_r.std() > 0:
        metrics["training/rollout_actor_probs_pearson_corr"] = float(np.corrcoef(p_t, p_r)[0, 1])
    return metrics


def _support_metrics(support: list[np.ndarray], unmasked: list[np.ndarray]) -> dict[str, float]:
    """The sampling-mask figures (module docstring); none without rows."""
    if not support or not sum(len(d) for d in support):
        return {}
    s, u = np.concatenate(support), np.concatenate(unmasked)
    return {"rollout_check/support_tokens": float(len(s)),
            "rollout_check/support_logprob_abs_diff_max": float(s.max()),
            "rollout_check/support_logprob_abs_diff_mean": float(s.mean()),
            "rollout_check/unmasked_logprob_abs_diff_max": float(u.max()),
            "rollout_check/unmasked_logprob_abs_diff_mean": float(u.mean())}


def _worst(samples: Sequence[Sample], where: list[tuple[int, np.ndarray]], rollout: list[np.ndarray],
           trainer: list[np.ndarray], flags: list[np.ndarray], count: int) -> list[TokenMismatch]:
    if count <= 0 or not any(len(p) for _, p in where):
        return []
    owner = np.concatenate([np.full(len(p), i) for i, p in where])
    position = np.concatenate([p for _, p in where])
    r = np.concatenate(rollout)
    t = np.concatenate(trainer)
    switched = np.concatenate(flags)
    diff = np.abs(t - r)
    order = np.argsort(-diff, kind="stable")[:count]
    out = []
    for k in order:
        sample = samples[int(owner[k])]
        meta = sample_metadata(sample)
        pos = int(position[k])
        out.append(TokenMismatch(
            sample=int(owner[k]), position=pos, token_id=int(sample.tokens[pos]), rollout_log_prob=float(r[k]),
            trainer_log_prob=float(t[k]), abs_diff=float(diff[k]), turn=meta.turn_at(pos),
            weight_version=meta.token_versions[pos], switched=bool(switched[k])))
    return out
