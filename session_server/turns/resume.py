"""Continuing a turn whose engine request the engine aborted for everyone (a weight update), instead of failing it.

SGLang aborts every in-flight request on `/update_weight_version`, `/update_weights_from_*` with
`abort_all_requests` and `/pause_generation` mode `abort`; the request comes back as HTTP 200 with an abort finish
reason and what it sampled so far. Answering 503 would make the agent redo the whole turn (and the trainer lose
what was sampled). So the turn goes on: its next engine request is prompt + the tokens already sampled, under a new
rid, with `max_new_tokens` reduced by them, sent the same way as the first (whole, or past what the SGLang streaming
session holds). The engine queues it while it is paused and runs it once it continues, under the new weights. The
pieces are joined by trajectory.join_results (every token's logprob and weight version kept), so the sample is
prompt + all sampled tokens with loss mask 1, and the agent sees one reply (a streamed one simply goes on).

Which aborts are continued is trajectory.continuable_abort's rule (an abort of everything, read from SGLang's
source). Every abort the server makes itself (client gone, DELETE, timeout, /admin/pause, shutdown) ends the turn
before its engine reply is read, so it never gets here. Not continued, and answered 503 as before: a turn past
--max-turn-continuations; a grammar-constrained turn that had sampled tokens (the grammar would restart at the
continuation's first token); one whose token budget is spent. The turn's deadline (--request-timeout) covers all of
its requests. What continuation cannot keep exact is the engine's sampling state across the cut: penalties count
output tokens from the continuation's start, and a stop string split across the cut is not seen.

What is kept between the requests, and what the next one asks for, is here (pure); the engine call
(engine_call.py) sends them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from session_server.engine.wire import CONSTRAINED_KEYS
from session_server.errors import EngineAbortedError
from trajectory import GenerateResult, continuable_abort


@dataclass(slots=True)
class Continuation:
    """One turn across its engine requests: what they sampled before the last abort, and how many followed."""

    limit: int
    before: GenerateResult | None = None
    count: int = 0

    def refusal(self, params: dict[str, Any], partial: GenerateResult | None) -> str | None:
        """Why a turn with these sampling params cannot go on after `partial` (a metrics label), or None."""
        if partial is None or not continuable_abort(partial.finish_reason):
            return "foreign"
        if self.count >= self.limit:
            return "limit"
        sampled = len(partial.output_ids)
        # The grammar's state (and the reasoning gate before it) starts again at the continuation's first token.
        if sampled and any(params.get(key) is not None for key in CONSTRAINED_KEYS):
            return "constrained"
        budget = params.get("max_new_tokens")
        if isinstance(budget, int) and sampled >= budget:
            return "budget"
        return None

    def go_on(self, params: dict[str, Any], aborted: EngineAbortedError) -> str:
        """Take what `aborted` sampled as the turn's so far, unless the turn cannot go on; what happened, as the
        metrics label: "continued", or why not (the engine call then answers with `aborted` itself)."""
        partial = aborted.partial
        refusal = self.refusal(params, partial)
        if refusal is not None:
            return refusal
        assert partial is not None
        self.before, self.count = partial, self.count + 1
        return "continued"

    def request(self, prompt: np.ndarray, params: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
        """The prompt and sampling params of the turn's next engine request: the turn's own, or after an abort its
        prompt + the tokens sampled so far, with `max_new_tokens` reduced by them."""
        before = self.before
        if before is None:
            return prompt, params
        params = dict(params)
        if isinstance(params.get("max_new_tokens"), int):
            params["max_new_tokens"] -= len(before.output_ids)
        return np.concatenate([prompt, before.output_ids]).astype(np.int32, copy=False), params
