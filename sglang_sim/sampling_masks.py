"""`return_sampling_mask`: the ids the sampler kept for each output token, as SGLang 0.5.23 reports them.

Why a model of the whole distribution: a kept set and its support logprob mean something only against a real
distribution over the vocabulary. The sim reports one logprob per sampled token (generation.py); here that token's
probability P = exp(logprob) heads a distribution whose other V - 1 tokens (ids token + 1, token + 2, ... modulo V)
take the rest, R = 1 - P, in a geometric run a_1 * rho^(j-1) with a_1 = min(P, R) / 2, so the sampled token is the
most likely one and the probabilities sum to one. The sampler's truncation is then SGLang's
(`top_k_top_p_min_p_sampling_from_probs_torch`, layers/sampler.py): over the probabilities sorted in descending order
a rank is kept when it is below `top_k`, when the mass before it is at most `top_p`, when its probability is at
least `min_p` times the largest, and when its probability is positive in float32. The support logprob of a kept id
is its probability over the kept mass (`_build_sampling_mask_output`): the full logprob minus the log-sum-exp of the
kept set's full logprobs. No token of such a distribution has a logprob below log(4 / V); the sim's low-temperature
logprobs can be that small, so a request with masks reports them raised to it (`floor`).

Refusals (scheduler.py, tokenizer_manager.py): `top_k` must be 1 (greedy; temperature 0 means top_k 1) or finite in
(1, --sampling-mask-max-tokens]; `sampling_logprobs_mode` needs `return_sampling_mask`.

The overflow abort: a realised support past the cap at some token (ties at the cut: a top-k kernel that keeps every
id tied with the k-th) ends the request there with `overflow_abort` (batch_result_processor.py
`get_sampling_mask_finish_reason`): that token is not emitted, a plain request is answered 400 with the message, a
streamed one ends with the abort as its final event (tokenizer_manager.py `_handle_abort_finish_reason`). The sim's
geometric run has no ties, so its support never passes top_k; the fault `mask_overflow` (faults.py) makes the reply's
middle token overflow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_sim.generation import SamplingParams

TOP_K_ALL = 1 << 30  # sampling_params.py: top_k -1 (or omitted) means the whole vocabulary
DEFAULT_MAX_TOKENS = 4096  # --sampling-mask-max-tokens
MODES = ("selected", "support")
_BISECT_STEPS = 64


def effective_top_k(params: SamplingParams) -> int:
    """SGLang's top_k after its normalisation: 1 for greedy (temperature 0), the whole vocabulary for -1."""
    if params.temperature <= 0:
        return 1
    return TOP_K_ALL if params.top_k == -1 else params.top_k


def refusal(params: SamplingParams, cap: int) -> str | None:
    """scheduler.py's text when the request's top_k cannot be masked, else None."""
    top_k = effective_top_k(params)
    if top_k != 1 and not 1 < top_k <= cap:
        return (f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= {cap}; got "
                f"top_k={top_k}. Lower top_k or increase --sampling-mask-max-tokens.")
    return None


def overflow_abort(cap: int) -> dict[str, Any]:
    """SGLang's finish reason for a token whose realised support exceeds the cap (FINISH_ABORT.to_json)."""
    return {"type": "abort",
            "message": (f"Sampling support exceeds --sampling-mask-max-tokens={cap}, commonly because of cutoff "
                        "ties. Lower top_k to leave more headroom or increase the server limit."),
            "status_code": 400, "err_type": "BadRequestError"}


def floor(vocab: int) -> float:
    """The smallest logprob a sampled token of the mask's distribution has (see the module docstring)."""
    return float(np.log(4.0 / vocab))


def _ratios(head: np.ndarray, rest: np.ndarray, vocab: int) -> np.ndarray:
    """Per token the rho with a_1 * (1 - rho^(V-1)) / (1 - rho) = rest, a_1 = head: bisection in float64."""
    target = np.where(head > 0, rest / np.maximum(head, 1e-300), 1.0)
    lo, hi = np.zeros_like(target), np.ones_like(target)
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        total = -np.expm1((vocab - 1) * np.log(mid)) / (1 - mid)
        lo, hi = np.where(total < target, mid, lo), np.where(total < target, hi, mid)
    return (lo + hi) / 2


def masks(ids: np.ndarray, logprobs: np.ndarray, params: SamplingParams, vocab: int,
          support: bool) -> dict[str, list[Any]]:
    """The meta lists of output tokens `ids` sampled at `logprobs`: `output_token_sampling_mask` and
    `output_token_sampling_logprobs` (one float per token, or one per kept id with `support`)."""
    n = len(ids)
    top_k = effective_top_k(params)
    if n == 0:
        return {"output_token_sampling_mask": [], "output_token_sampling_logprobs": []}
    if top_k == 1:  # sampler.py _build_greedy_sampling_mask_output: the argmax alone, logprob 0
        return {"output_token_sampling_mask": [[int(t)] for t in ids],
                "output_token_sampling_logprobs": [[0.0] if support else 0.0 for _ in ids]}
    p = np.exp(np.maximum(logprobs.astype(np.float64), floor(vocab)))
    rest = np.maximum(1.0 - p, 0.0)
    head = np.minimum(p, rest) / 2
    rho = _ratios(head, rest, vocab)
    width = min(top_k, vocab)
    ranks = np.arange(1, width)  # the alternatives' ranks (the sampled token is rank 0)
    alt = head[:, None] * rho[:, None] ** (ranks - 1)[None, :]
    probs = np.concatenate([p[:, None], alt], axis=1)
    before = np.cumsum(probs, axis=1) - probs  # the mass ranked before each
    keep = (before <= params.top_p) & (probs.astype(np.float32) > 0)
    if params.min_p > 0:
        keep &= probs >= params.min_p * p[:, None]
    keep[:, 0] = True
    counts = keep.sum(axis=1)  # every condition holds on a prefix of the ranks
    rows: list[list[int]] = []
    values: list[Any] = []
    for i in range(n):
        k = int(counts[i])
        kept = probs[i, :k]
        mass = float(kept.sum())
        token = int(ids[i])
        rows.append([token, *((token + j) % vocab for j in range(1, k))])
        values.append(np.log(kept / mass).astype(np.float32).tolist() if support else
                      float(np.float32(np.log(p[i] / mass))))
    return {"output_token_sampling_mask": rows, "output_token_sampling_logprobs": values}
