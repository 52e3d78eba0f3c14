"""Token ids on replies, for trainers that capture them from the API instead of collecting samples.

Capture-style frameworks (ART, agent-lightning, rLLM, TRL's OpenEnv proxy) read each model call's token ids off the
reply, as vLLM writes them when a request asks `return_token_ids: true`: `prompt_token_ids` beside the choices and
`token_ids` in each choice. NeMo Gym reads the Responses output items of a call, whose last item carries
`prompt_token_ids`, `generation_token_ids` and `generation_log_probs`. A request asks with `return_token_ids`
(Chat Completions and Responses), or the server puts them on every reply (`--return-token-ids`) unless the request
says `false`.

The ids are the session's own: the prompt is the turn's TITO prompt (the stored ids of earlier turns plus the
appended messages' tokens, never a re-render), the generation is every token the engine sampled for the turn (its
continuations after an engine-wide abort included, and the stop token), and prompt + generation is exactly what the
trajectory holds once the turn is committed. The logprobs are the engine's, as the samples carry them.
"""

from __future__ import annotations

from dataclasses import dataclass

from session_server.turns.output import TurnOutput
from trajectory import TurnPlan

FIELD = "return_token_ids"


@dataclass(frozen=True, slots=True)
class TurnTokens:
    """One turn's token ids as a reply carries them (plain lists: they go straight into the reply's JSON)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]


def turn_tokens(wanted: bool, plan: TurnPlan, out: TurnOutput) -> TurnTokens | None:
    """The turn's ids for its reply, or None when nobody asked for them."""
    if not wanted:
        return None
    result = out.result
    return TurnTokens(plan.prompt_ids.tolist(), result.output_ids.tolist(), result.logprobs.tolist())
