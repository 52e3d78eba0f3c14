"""Which turns can be replayed with sampling masks, decided on the engine's sampling params (every API alike).

With masks on (`--return-sampling-masks`, or `return_sampling_masks` at POST /sessions) every engine call asks SGLang
for the ids its sampler kept per token (docs/design.md 5.1), so a trainer renormalises its logprobs over the same
set. That is exact only when the row is the whole story: the kept set must be bounded (SGLang refuses a mask without
a finite top_k, and a top_k above its `--sampling-mask-max-tokens`), and the probabilities inside it must be the
model's own, temperature aside. So, before any engine call, with a 400 that names the field:

- `top_k`: none given (or -1) while sampling is not greedy: filled in from `--sampling-mask-top-k` when the operator
  set one, else refused (top_p < 1 alone cannot be recorded: SGLang needs the top-k bound). Above the cap: refused.
- `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`: they reshape the distribution per
  token from the history, which the trainer's forward pass does not do: refused unless neutral (0, 0, 1, empty).
- `min_p` is allowed: SGLang's sampler (layers/sampler.py, every backend) zeroes the tokens under `min_p` times the
  largest probability before it captures the kept set, so the row records its effect exactly. Constrained decoding
  is allowed for the same reason: its grammar removes tokens before sampling and leaves the others' proportions.

A request can pass these and still not be recordable: SGLang aborts it where a token's kept set holds more ids than
its `--sampling-mask-max-tokens` (ties at the top-k cut), with status 400 (a plain request's answer, a streamed
one's last event, possibly after tokens were streamed). `support_overflow` reads that abort: the agent gets a 400 in
its API's shape, code `sampling_support_overflow`, with SGLang's text, plain or streamed alike; nothing is committed,
and the turn is not continued or retried (the same top_k may tie again: lower it, or raise the engine's cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from session_server.config import ServerConfig
from session_server.errors import EngineRefusedError, engine_message
from session_server.sessions.session import Session
from trajectory.errors import RequestValidationError

# The neutral value of each sampling key that reshapes the distribution (SGLang's defaults).
NEUTRAL: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


class UnreplayableSamplingError(RequestValidationError):
    """A request whose sampling cannot be recorded exactly with masks on (400)."""

    code = "sampling_not_replayable"


class SamplingSupportOverflowError(RequestValidationError):
    """The engine aborted the reply: one token's kept set passed its mask cap (400; see the module docstring)."""

    code = "sampling_support_overflow"


# How SGLang 0.5.23 begins the abort's message (batch_result_processor.py `get_sampling_mask_finish_reason`).
OVERFLOW_MESSAGE = "Sampling support exceeds --sampling-mask-max-tokens"


def support_overflow(refused: EngineRefusedError) -> SamplingSupportOverflowError | None:
    """The engine's refusal as the overflow abort it is (status 400, SGLang's text), else None."""
    message = engine_message(refused.body)
    if refused.engine_status != 400 or not message.startswith(OVERFLOW_MESSAGE):
        return None
    return SamplingSupportOverflowError(f"the engine aborted the reply with sampling masks on: {message}")


@dataclass(frozen=True, slots=True)
class SamplingMaskPolicy:
    """`default_top_k`: what a request without a top-k bound gets (None: such a request is refused); `max_top_k`: the
    engine's `--sampling-mask-max-tokens`."""

    default_top_k: int | None = None
    max_top_k: int = 4096

    def apply(self, sp: dict[str, Any]) -> int:
        """Check (and fill in) the engine's sampling params in place; returns the rows' bound, the top_k the engine
        samples with (1 when greedy)."""
        for key, neutral in NEUTRAL.items():
            if sp.get(key) is not None and sp[key] != neutral:
                raise UnreplayableSamplingError(f"'{key}' must be {neutral} (or left out) on a session that records "
                                                "sampling masks: it reshapes the distribution the mask is taken from")
        if sp.get("logit_bias"):
            raise UnreplayableSamplingError("'logit_bias' cannot be used on a session that records sampling masks: "
                                            "it reshapes the distribution the mask is taken from")
        if sp.get("temperature") == 0:
            return 1  # greedy: SGLang samples the argmax, a row of one id
        top_k = sp.get("top_k")
        if top_k is None or top_k == -1:
            if self.default_top_k is None:
                raise UnreplayableSamplingError(
                    "'top_k' is required on a session that records sampling masks (an integer in [1, "
                    f"{self.max_top_k}]): the engine records the kept tokens only under a top-k bound"
                    + (" (top_p alone is not one)" if sp.get("top_p", 1.0) < 1 else ""))
            top_k = sp["top_k"] = self.default_top_k
        if top_k > self.max_top_k:
            raise UnreplayableSamplingError(f"'top_k' {top_k} is above {self.max_top_k}, the most a sampling mask "
                                            "records (the engine's --sampling-mask-max-tokens)")
        return int(top_k)


def mask_policy(config: ServerConfig, session: Session) -> SamplingMaskPolicy | None:
    """What the turns of `session` do about sampling masks: None when they ask for none."""
    wanted = config.return_sampling_masks if session.sampling_masks is None else session.sampling_masks
    if not wanted:
        return None
    return SamplingMaskPolicy(config.sampling_mask_top_k or None, config.sampling_mask_max_tokens)
