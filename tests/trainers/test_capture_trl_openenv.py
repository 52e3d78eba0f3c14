"""TRL's OpenEnv path against our replies (trl 1.16.0 with openenv 0.10.0): OpenEnv's capture proxy
(`openenv.core.harness.capture.server.create_app`, at capture level "tokens") run in-process in front of one session
of our server, the agent on the official openai SDK through it with the capture session's id as its key.

The proxy adds `logprobs`, `return_token_ids` and `top_logprobs: 0` to each request, forwards it non-streamed,
normalises the reply (`upstream.normalize_response`) and records the turn from `prompt_token_ids`,
`choices[0].token_ids` and `choices[0].logprobs.content` after validating it (`validate.check_turn`). TRL's loop-owning
harness fetches the session's training trace (GET /sessions/{id}/trace_entries, read as OpenEnv's `TrainingTrace`,
whose every turn is validated again) and turns it into its own turn records (`openenv_harness.
_turns_from_training_trace`) and training rows (`async_rollout_worker._chain_to_sequences`).

What must hold: TRL's turn records are the session's calls exactly (prompt ids, completion ids, logprobs), they chain
into one training row with no drift (each prompt extends the last turn's ids), and that row is the session's sample:
its tokens, its loss mask past the first prompt, its logprobs. The proxy had to work around nothing (no parameter of
its request was rejected) and recorded no finding against any turn.

OpenEnv decides an endpoint's capture level by probing it (`validate_llm.validate_llm`); on a session's base URL the
probe grades "tokens" (ids present and aligned, nothing to work around). Its temperature probe of the logprobs
(`probe_logprobs_mode`) is left out: it compares the top-2 `top_logprobs` gap at two temperatures, and sglang-sim's
alternatives do not scale with temperature (a real engine's do; the server passes the request's temperature on), so
against the sim it would read "raw" whatever the server did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
from capture_episode import (
    TOOLS,
    Call,
    CallIds,
    Stored,
    assert_recovered,
    run_compacted_episode,
    run_episode,
    session_base,
)
from openenv.core.harness import TrainingTrace
from openenv.core.harness.capture.server import create_app
from openenv.core.harness.capture.validate_llm import validate_llm
from sample_checks import sampled_runs
from starlette.testclient import TestClient
from trl.experimental.async_grpo.async_rollout_worker import _chain_to_sequences
from trl.experimental.async_grpo.openenv_harness import _turns_from_training_trace

from support.server import new_session
from support.stack import Stack
from trajectory import Sample


@contextlib.contextmanager
def capture_proxy(llm_url: str) -> Iterator[TestClient]:
    """OpenEnv's capture app forwarding to `llm_url` (its lifespan run by the test client)."""
    with TestClient(create_app(llm_url=llm_url, model="m", capture_level="tokens", max_output_tokens=None)) as client:
        yield client


def openenv_episode(server: str, runner: Callable[[str, Callable[[str], Call]], Stored]) -> tuple[Stored, Any]:
    """Run an episode (`runner`) through OpenEnv's capture proxy in front of a session; return what the session
    stored and TRL's turn records of the proxy's training trace. The proxy must have recorded no finding against any
    turn and worked around no parameter of its requests."""
    with contextlib.ExitStack() as stack:
        state: dict[str, Any] = {}

        def call_for(sid: str) -> Call:
            http = state["proxy"] = stack.enter_context(capture_proxy(session_base(server, sid)))
            created = http.post("/sessions", json={})
            assert created.status_code == 200, created.text
            state["capture_id"] = created.json()["session_id"]
            sdk = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=state["capture_id"], http_client=http,
                                max_retries=0)

            def call(messages: list[dict[str, Any]]) -> dict[str, Any]:
                completion = sdk.chat.completions.create(model="agent", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
                return completion.choices[0].message.model_dump(exclude_none=True)

            return call

        stored = runner(server, call_for)
        proxy: TestClient = state["proxy"]
        session = proxy.app.state.registry.get(state["capture_id"])  # type: ignore[attr-defined]
        assert proxy.app.state.inference.param_fixes == []  # type: ignore[attr-defined]
        assert session.findings == [], session.findings
        fetched = proxy.get(f"/sessions/{state['capture_id']}/trace_entries")
        assert fetched.status_code == 200, fetched.text
        trace = TrainingTrace.from_entries(fetched.json()["entries"])
    turns = _turns_from_training_trace(trace)
    assert all(t.output_mask == [1] * len(t.output_ids) for t in turns)
    return stored, turns


def assert_row_is_sample(row: Any, sample: Sample) -> None:
    """TRL's training row is the sample: its tokens, its mask past the first prompt (nothing trained before), its
    logprobs (0 off the mask)."""
    first = sampled_runs(sample)[0][0]
    assert row.input_ids == sample.tokens.tolist()
    assert row.completion_mask[first:] == sample.loss_mask[first:].tolist()
    assert not any(row.completion_mask[:first])
    assert np.array_equal(np.asarray(row.old_log_probs, np.float32), sample.rollout_log_probs)


def test_trl_reads_the_openenv_trace_as_the_sessions_ids(trainer_stack: Stack) -> None:
    stored, turns = openenv_episode(trainer_stack.server, run_episode)
    assert_recovered(stored, [CallIds(t.prompt_ids, t.output_ids, t.output_log_probs) for t in turns])
    (row,), tally = _chain_to_sequences(turns, "rollout", 0)
    assert tally["clean"] == len(turns) - 1 and tally["fork"] == tally["realign"] == 0
    assert_row_is_sample(row, stored.sample)


def test_a_compacted_session_is_a_row_per_segment(trainer_stack: Stack) -> None:
    """After the agent compacts its history, the next call's prompt is the new segment's, not an extension: TRL forks
    there (lossless capture: fork threshold 0), and its two rows are the session's two samples."""
    stored, turns = openenv_episode(trainer_stack.server, run_compacted_episode)
    assert [CallIds(t.prompt_ids, t.output_ids, t.output_log_probs) for t in turns] == stored.calls
    rows, tally = _chain_to_sequences(turns, "rollout", 0)
    assert tally["fork"] == 1 and tally["clean"] == 3 and tally["realign"] == 0
    assert len(rows) == len(stored.samples) == 2
    for row, sample in zip(rows, stored.samples, strict=True):
        assert_row_is_sample(row, sample)


def test_openenv_probe_grades_a_session_trainable(trainer_stack: Stack) -> None:
    base = session_base(trainer_stack.server, new_session(trainer_stack.server))
    listed = httpx.get(f"{base}/models", timeout=30).json()["data"]
    (model,) = [m["id"] for m in listed if not m.get("parent")]  # the base model (the sim's adapter lists its parent)
    report = validate_llm(base, model, timeout=60.0, check_logprobs_mode=False, check_tools=False)
    assert report.ok and report.capture_level == "tokens", report
    assert report.param_fixes == [] and report.n_prompt_ids > 0 and report.n_completion_ids > 0
