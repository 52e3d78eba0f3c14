"""A turn's output: the engine reply, strictly validated, and the assistant message the family parses from it.

What every API's reply is built from (the front ends only format it). Pure, so it runs on the CPU pool with the
front end's formatting in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from session_server.engine.wire import decode_engine_reply
from session_server.errors import EngineAbortedError
from trajectory import GenerateResult, ModelFamily, TurnPlan, join_results
from trajectory.continuation import cut_to_version


@dataclass(slots=True)
class TurnOutput:
    result: GenerateResult
    message: dict[str, Any]  # the assistant message to commit


def call_id_prefix(rid: str) -> str:
    """The ids of a turn's tool calls (`call_<rid>`, then `_<i>` per call): stored with the turn, so the agent's
    echo of them matches the history."""
    return f"call_{rid[:24]}"


def decode_turn(
    body: bytes, family: ModelFamily, rid: str, parse_tool_calls: bool = True,
    split: tuple[bytes, memoryview | None] | None = None, retry_after: int = 1, plan: TurnPlan | None = None,
    before: GenerateResult | None = None, sampling_mask_bound: int | None = None, version: str | None = None,
) -> TurnOutput:
    """Strictly validate the engine reply (502 on any rule) and parse it with the family. A reply the engine itself
    aborted is EngineAbortedError (503 with `retry_after`): there is nothing to commit.

    `split` is `split_routed_experts(body)` when the caller already made the cut (to size the work that is left).
    `plan` is the turn's: its tools type XML tool-call arguments, and its `reply_opening` (the start of the reply the
    prompt already wrote, Qwen3.5's `<think>\n`) is parsed in front of the engine's text. `before`: what earlier
    engine requests of this turn sampled before the engine aborted them (turns/resume.py); the reply continues it.
    `sampling_mask_bound`: the turn asked for sampling masks under this top-k (TurnRequest.sampling_mask_bound).
    `version`: the weights the request's cache key named; tokens of other weights are cut off (cut_to_version) and
    the turn goes on from the rest, as after an abort.
    """
    result = decode_engine_reply(body, family.vocab_size, split, sampling_mask_bound)
    if version is not None:
        result = cut_to_version(result, version, family.decode) or result
    if before is not None:
        result = join_results(before, result)
    if result.finish_reason.get("type") == "abort":
        raise EngineAbortedError("the engine aborted the request; retry the same turn", retry_after, result)
    opening, tools = (plan.reply_opening, plan.tools) if plan is not None else ("", None)
    parsed = family.parse_reply(opening + result.text, parse_tool_calls, tools)
    return TurnOutput(result, parsed.to_message(call_id_prefix(rid)))
