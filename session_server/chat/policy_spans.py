"""ART's policy token spans on a Chat Completions choice: which LoRA adapter revision scored the turn's tokens.

ART (openpipe-art 0.5.23, `art/preprocessing/policy_spans.py`) reads `policy_token_spans` (the completion, from token
0) and `prompt_policy_token_spans` (the prompt's tokens with a causal logprob, from token 1) off each choice, each a
list of `{start_token, end_token, generation_id, policy_version, lora_slot, update_seq}`, and in its "require" mode
refuses a reply without both. A turn of this server runs on one adapter revision from its first engine request to
its last (engine/adapters.py), whose prompt KV that revision computed too (the cache key names it), so each list is
one span: `policy_version` and `update_seq` the revision, `lora_slot` the name the engine serves it under. A turn on
the base model, or on a revision that is not a number (ART's versions are integers), carries none.
"""

from __future__ import annotations

from typing import Any

from session_server.engine.adapters import AdapterRef

POLICY_TOKEN_SPANS = "policy_token_spans"
PROMPT_POLICY_TOKEN_SPANS = "prompt_policy_token_spans"


def policy_token_spans(adapter: AdapterRef | None, rid: str, prompt_tokens: int,
                       completion_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """The two choice fields for a turn on `adapter` ({} for the base model or a non-numeric revision)."""
    if adapter is None or not adapter.revision.isdecimal() or completion_tokens <= 0:
        return {}
    version = int(adapter.revision)

    def span(start: int, end: int) -> dict[str, Any]:
        return {"start_token": start, "end_token": end, "generation_id": rid, "policy_version": version,
                "lora_slot": adapter.engine_name, "update_seq": version}

    return {PROMPT_POLICY_TOKEN_SPANS: [span(1, prompt_tokens)] if prompt_tokens > 1 else [],
            POLICY_TOKEN_SPANS: [span(0, completion_tokens)]}
