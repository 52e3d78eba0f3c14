"""The episode the capture-framework tests run (tests/trainers/test_capture_*.py), and what each of its model calls
must read back as.

A capture framework (ART, agent-lightning, rLLM, OpenEnv under TRL) never collects our samples: it sits between the
agent and the model, reads each reply's `prompt_token_ids`, `choices[0].token_ids` and logprobs, and trains on those.
Each test drives this one episode through the framework's own client or proxy (`Call`: messages -> the assistant
message it got back), runs the framework's own reader on what came back, and hands the ids it recovered to
`assert_recovered`, which holds them to the session's stored sample: call k's prompt is the sample up to turn k's
first sampled token, its completion is that turn's sampled run, its logprobs the sample's there, so every prompt is a
prefix of the stored tokens and extends the previous call's prompt + completion.

The episode: three calls on one session, two tool calls whose results are fed back, then a plain reply
(`run_episode`). A compacted one (`run_compacted_episode`) holds two segments, whose calls read back per segment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from sample_checks import sampled_runs

from sglang_sim.directives import reply, tokens, tool_call
from support.server import new_session
from trajectory import Sample, samples_from_json

SYSTEM = {"role": "system", "content": "You are a coding agent."}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
ASK = {"return_token_ids": True}  # the request field, as vLLM spells it (extra_body for the openai SDK)
CALLS = 3

Call = Callable[[list[dict[str, Any]]], dict[str, Any]]  # the messages so far -> the reply's assistant message


@dataclass(frozen=True)
class CallIds:
    """One model call's ids as a framework recovered them (or as the sample says they are)."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float] | None  # None where the framework's reader does not read them


@dataclass
class Stored:
    """The session's own record of the episode: its samples (one per segment) and, per call in order, the ids the
    samples say it had."""

    session_id: str
    samples: list[Sample]
    calls: list[CallIds]

    @property
    def sample(self) -> Sample:
        (one,) = self.samples
        return one


def session_base(server: str, session_id: str) -> str:
    """The OpenAI base URL of one session (what a framework's proxy forwards to)."""
    return f"{server}/sessions/{session_id}/v1"


def run_episode(server: str, call_for: Callable[[str], Call]) -> Stored:
    """Open a session, run the three calls through `call_for(session_id)` and return what the session stored."""
    sid = new_session(server)
    call = call_for(sid)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"fix it {tool_call('run', cmd='ls')}"}]
    for k in range(CALLS):
        message = call(messages)
        messages.append(message)
        if k < CALLS - 1:
            calls = message.get("tool_calls")
            assert calls, message
            nxt = tool_call("run", cmd=f"step {k}") if k == 0 else reply("All done.")
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"],
                             "content": f"output {k} {tokens(3)} {nxt}"})
        else:
            assert not message.get("tool_calls"), message
    return stored(server, sid)


def run_compacted_episode(server: str, call_for: Callable[[str], Call]) -> Stored:
    """Five calls whose history the agent compacts before the fourth (a new system prompt + summary), so the session
    holds two segments: calls 1-3 in the first sample, 4-5 in the second."""
    sid = new_session(server)
    call = call_for(sid)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"fix it {tool_call('run', cmd='ls')}"}]
    for k in range(5):
        if k == 3:
            messages = [SYSTEM, {"role": "user", "content": "Summary: listed, built and tested. Continue. "
                                                            f"{tool_call('run', cmd='ship')}"}]
        message = call(messages)
        messages.append(message)
        if message.get("tool_calls"):
            nxt = tool_call("run", cmd=f"step {k}") if k < 2 else reply("All done.")
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": f"output {k} {nxt}"})
    result = stored(server, sid)
    assert [len(sampled_runs(s)) for s in result.samples] == [3, 2]
    return result


def stored(server: str, session_id: str) -> Stored:
    """The session's samples, cut into the calls' expected ids; a one-segment session's sample is its trajectory
    (GET /sessions/{id})."""
    samples = samples_from_json(httpx.post(f"{server}/sessions/{session_id}/samples", json={}, timeout=30).json())
    if len(samples) == 1:
        held = httpx.get(f"{server}/sessions/{session_id}", timeout=30).json()["token_ids"]
        assert samples[0].tokens.tolist() == list(held)
    calls = []
    for sample in samples:
        tokens_ = sample.tokens.tolist()
        calls += [CallIds(tokens_[:start], tokens_[start:end],
                          sample.rollout_log_probs[start:end].astype(float).tolist())
                  for start, end in sampled_runs(sample)]
    return Stored(session_id, samples, calls)


def assert_recovered(stored_: Stored, recovered: Sequence[CallIds], *, logprobs: bool = True) -> None:
    """The ids a framework read off the replies are the session's, call by call, exactly; with `logprobs`, so are its
    logprobs. Across calls each prompt extends the previous prompt + completion (never a re-render)."""
    assert len(stored_.calls) == CALLS and len(recovered) == CALLS
    tokens_ = stored_.sample.tokens.tolist()
    previous: list[int] = []
    for got, want in zip(recovered, stored_.calls, strict=True):
        assert got.prompt, "the framework recovered no prompt ids"
        assert got.completion, "the framework recovered no completion ids"
        assert got.prompt == want.prompt
        assert got.completion == want.completion
        assert tokens_[: len(got.prompt) + len(got.completion)] == got.prompt + got.completion
        assert got.prompt[: len(previous)] == previous
        previous = got.prompt + got.completion
        if logprobs:
            assert got.logprobs is not None, "the framework recovered no logprobs"
            assert np.array_equal(np.asarray(got.logprobs, dtype=np.float32), np.asarray(want.logprobs, np.float32))
    # the last call's prompt + completion is the whole stored trajectory
    assert previous == tokens_


def assembled_message(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message of a streamed reply, its content and tool calls joined from the chunks' deltas (what
    the agent appends to its history before the next call)."""
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(call["index"], {"id": "", "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
            slot["id"] = call.get("id") or slot["id"]
            slot["function"]["name"] += (call.get("function") or {}).get("name") or ""
            slot["function"]["arguments"] += (call.get("function") or {}).get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(d.get("content") or "" for d in deltas)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
