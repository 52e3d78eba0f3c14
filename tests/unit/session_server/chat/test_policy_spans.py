"""session_server/chat/policy_spans.py: ART's spans for a turn on an adapter revision, none for the base model."""

from __future__ import annotations

from session_server.chat.policy_spans import POLICY_TOKEN_SPANS, PROMPT_POLICY_TOKEN_SPANS, policy_token_spans
from session_server.engine.adapters import AdapterRef


def test_a_turn_on_a_revision_is_one_span_over_its_completion_and_one_over_its_scored_prompt() -> None:
    spans = policy_token_spans(AdapterRef("a1", "3"), "rid1", prompt_tokens=10, completion_tokens=4)
    one = {"generation_id": "rid1", "policy_version": 3, "lora_slot": "a1@3", "update_seq": 3}
    assert spans[POLICY_TOKEN_SPANS] == [{"start_token": 0, "end_token": 4, **one}]
    assert spans[PROMPT_POLICY_TOKEN_SPANS] == [{"start_token": 1, "end_token": 10, **one}]  # token 0 has no logprob
    first = policy_token_spans(AdapterRef("a1", "0"), "rid2", prompt_tokens=1, completion_tokens=2)
    assert first[PROMPT_POLICY_TOKEN_SPANS] == [] and first[POLICY_TOKEN_SPANS][0]["lora_slot"] == "a1"


def test_the_base_model_an_empty_reply_and_a_non_numeric_revision_carry_none() -> None:
    assert policy_token_spans(None, "rid", 10, 4) == {}
    assert policy_token_spans(AdapterRef("a1", "3"), "rid", 10, 0) == {}
    assert policy_token_spans(AdapterRef("a1", "v2"), "rid", 10, 4) == {}  # ART's versions are integers
