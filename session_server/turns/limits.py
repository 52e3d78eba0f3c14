"""Limits on one turn's tokens: the engine's context and --max-session-tokens, checked as early as each can be.

Before rendering, a cheap lower bound on the prompt (trajectory/bounds.py) refuses a prompt that could never fit the
engine's context, without rendering or tokenizing megabytes for the engine to refuse anyway. After rendering, the
exact prompt length is checked against both limits, and generation is capped so that the session never holds more
than --max-session-tokens. Both refusals are 400s that say which limit, counted in /metrics (limit_refusals).

The engine's limit is learned from its `/server_info` (`max_req_input_len`, which SGLang derives from the context
length and the KV pool; `context_length - 1` where only that is reported) by `learn_prompt_limit`, which keeps asking
until the engine answers; until then only the session limit applies.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from session_server.engine.reasoning import ungated_grammar_warning
from session_server.errors import LimitExceededError
from trajectory import ModelFamily, TurnPlan
from trajectory.bounds import min_prompt_tokens
from trajectory.images import NO_IMAGE_LIMITS, ImageLimits

if TYPE_CHECKING:
    from session_server.state import ServerState

logger = logging.getLogger("session_server")


@dataclass(frozen=True, slots=True)
class TurnLimits:
    prompt_tokens: int | None = None  # the engine's largest input; None: not known (yet)
    session_tokens: int = 0  # --max-session-tokens; 0: none
    images: ImageLimits = NO_IMAGE_LIMITS  # a request's images (frontend/images.py)

    def before_render(self, messages: Any, family: ModelFamily, body_bytes: int) -> None:
        """`body_bytes`: the size of the request body the messages came from. The bound counts at most one token per
        character of message text, and every character takes at least a byte of the body, so a body no larger than
        the limit is not even walked (the common case: agents resend their whole history every turn)."""
        limit = self.prompt_tokens
        if limit is None or body_bytes <= limit:
            return
        at_least = min_prompt_tokens(messages, family.max_token_chars, limit)
        if at_least > limit:
            raise LimitExceededError(
                f"the prompt needs more than {limit} tokens (at least {at_least} counted before stopping); the "
                f"engine accepts at most {limit} input tokens", "context",
            )

    def after_render(self, plan: TurnPlan, sampling_params: dict[str, Any]) -> None:
        prompt = len(plan.prompt_ids)
        if self.prompt_tokens is not None and prompt > self.prompt_tokens:
            raise LimitExceededError(
                f"the prompt has {prompt} tokens; the engine accepts at most {self.prompt_tokens} input tokens",
                "context",
            )
        if not self.session_tokens:
            return
        room = self.session_tokens - prompt
        if room < 1:
            raise LimitExceededError(
                f"the session would hold {prompt} tokens before generating; --max-session-tokens is "
                f"{self.session_tokens}: start a new session", "session_tokens",
            )
        requested = sampling_params.get("max_new_tokens")
        sampling_params["max_new_tokens"] = room if requested is None else min(requested, room)


def _prompt_limit(info: dict[str, Any]) -> int | None:
    value = info.get("max_req_input_len")
    if type(value) is int and value > 0:
        return value
    context = info.get("context_length")
    if type(context) is int and context > 1:
        return context - 1
    return None


async def learn_prompt_limit(server: ServerState, retry: float = 2.0) -> None:
    """Ask the engine's /server_info until it tells its prompt limit; store it on the server state. Its first answer
    also says whether the engine gates grammars behind the model's reasoning (engine/reasoning.py)."""
    told = False
    while True:
        info = await server.engine.server_info()
        if info is not None and not told:
            told = True
            warning = ungated_grammar_warning(info, server.family)
            if warning is not None:
                logger.warning("%s", warning)
        limit = _prompt_limit(info) if info is not None else None
        if limit is not None:
            server.prompt_token_limit = limit
            logger.info("engine accepts prompts of up to %d tokens", limit)
            return
        await asyncio.sleep(retry)
