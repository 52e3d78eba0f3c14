"""Sampling masks on released SGLang 0.5.23 (issue 42): a multi-turn tool episode through Chat (plain and streamed),
Responses and Anthropic Messages, sampled with top_p 0.9 / top_k 20 on a session server that asks for masks.

Every sampled token's row holds it, and the trainer's recompute (transformers, fp32, the same checkpoint)
renormalised over the row matches the engine's sampling logprob within 1e-3, while the full-vocabulary recompute
does not: the tiny random model's top 20 hold a small part of the mass, so a ratio without the rows is far off.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.logprob_check import check_logprobs
from support.server import chat_content, chat_url, new_session
from support.sglang_engine import Served, ServeFactory
from trajectory import Sample, samples_from_json

ATOL = 1e-3  # docs/design.md 6
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 20}


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    # Responses has no top_k field: the server's --sampling-mask-top-k gives its turns top_k 20.
    with serve("dense", "--return-sampling-masks", "--sampling-mask-top-k", "20", proxied=False) as s:
        yield s


@pytest.fixture(scope="module")
def policy(served: Served) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(served.checkpoint, dtype=torch.float32).eval()


def merged_sample(served: Served, sid: str, turns: int) -> Sample:
    r = httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30)
    assert r.status_code == 200, r.text
    (sample,) = samples_from_json(r.json())
    assert sample.metadata["num_turns"] == turns
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204
    return sample


def assert_replayable(sample: Sample, policy: torch.nn.Module) -> None:
    """Rows hold their sampled ids (at most 20, none off the loss mask); the support recompute matches the engine's
    sampling logprob, the full-vocabulary one does not."""
    masks = sample.sampling_masks
    assert masks is not None and len(masks) == len(sample.tokens)
    for p in range(len(sample.tokens)):
        row = masks.row(p).tolist()
        assert (sample.tokens[p] in row and 1 <= len(row) <= 20) if sample.loss_mask[p] else row == []
    report = check_logprobs([sample], policy, temperature=1.0)
    m = report.metrics
    print(f"\n{report.format().splitlines()[0]}\n  support mean {m['rollout_check/support_logprob_abs_diff_mean']:.3g}"
          f", full vocabulary mean {m['rollout_check/unmasked_logprob_abs_diff_mean']:.3g}")
    assert m["rollout_check/support_tokens"] == int(sample.loss_mask[1:].sum())
    assert report.ok(ATOL), report.format()  # the engine's full-vocabulary logprobs, recomputed
    assert report.ok_support(ATOL), report.format()
    assert m["rollout_check/unmasked_logprob_abs_diff_mean"] > 100 * ATOL, report.format()
    engine = masks.logprobs[sample.loss_mask == 1]
    assert (engine >= sample.rollout_log_probs[sample.loss_mask == 1] - 1e-4).all()


def tool_result(turn: int) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{turn}", "content": json.dumps({"key": f"k{turn}", "value": turn})}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_chat_completions(served: Served, policy: torch.nn.Module, stream: bool) -> None:
    sid = new_session(served.server)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Look up k0, then k1."}]
    for turn in range(3):
        content = chat_content(served.server, sid, {"messages": history, "tools": TOOLS, "max_tokens": 8,
                                                    "stream": stream, **SAMPLING})
        history += [{"role": "assistant", "content": content}, tool_result(turn)]
    assert_replayable(merged_sample(served, sid, 3), policy)


def test_responses(served: Served, policy: torch.nn.Module) -> None:
    sid = new_session(served.server)
    url = f"{served.server}/sessions/{sid}/v1/responses"
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    previous = None
    for turn in range(3):
        body: dict[str, Any] = {"model": "m", "tools": tools, "max_output_tokens": 8, "temperature": 1.0,
                                "top_p": 0.9, "input": "Look up k0." if previous is None else [
                                    {"type": "function_call_output", "call_id": f"call_{turn}",
                                     "output": tool_result(turn)["content"]}]}
        if previous:
            body["previous_response_id"] = previous
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
    assert_replayable(merged_sample(served, sid, 3), policy)


def test_anthropic_messages(served: Served, policy: torch.nn.Module) -> None:
    sid = new_session(served.server)
    url = f"{served.server}/sessions/{sid}/v1/messages"
    tools = [{"name": "lookup", "description": "Look a key up.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    history: list[dict[str, Any]] = [{"role": "user", "content": "Look up k0."}]
    for turn in range(3):
        r = httpx.post(url, timeout=120, json={"model": "m", "max_tokens": 8, "tools": tools, "messages": history,
                                                "temperature": 1.0, "top_p": 0.9, "top_k": 20})
        assert r.status_code == 200, r.text
        history += [{"role": "assistant", "content": r.json()["content"]},
                    {"role": "user", "content": f"Result {turn}: {tool_result(turn)['content']}"}]
    assert_replayable(merged_sample(served, sid, 3), policy)


def test_greedy_turns_have_rows_of_one(served: Served) -> None:
    """Temperature 0 needs no top_k: each row is the argmax alone, its sampling logprob 0."""
    sid = new_session(served.server)
    r = httpx.post(chat_url(served.server, sid), timeout=120, json={
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 6})
    assert r.status_code == 200, r.text
    sample = merged_sample(served, sid, 1)
    masks = sample.sampling_masks
    assert masks is not None
    on = np.flatnonzero(sample.loss_mask)
    assert [masks.row(int(p)).tolist() for p in on] == [[int(sample.tokens[p])] for p in on]
    assert (masks.logprobs[on] == 0).all()
