"""agent-lightning's capture path against our replies (agentlightning 1.0.2): its server app run in-process, our
session registered as its model endpoint, the agent on the official openai SDK through its LLM proxy
(/proxy/rollout/{id}/attempt/{attempt}/mode/train/openai/v1), which adds `return_token_ids` and `logprobs` to each
request and records the reply as a `model_request` event. The trainer reads the rollout's events in the triplet
format (`routes.events._trim_model_request`: `prompt_token_ids` at the top, `choices[0].token_ids`, the chosen
tokens' logprobs from `choices[0].logprobs.content`); those must be the session's ids and logprobs, call by call.

Its proxy refuses streams; a streamed reply's chunks are read by the same function's chunk-list branch.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import openai
from agentlightning.schemas import DEFAULT_ATTEMPT_ID
from agentlightning.server.app import create_app
from agentlightning.server.routes.events import _trim_model_request
from capture_episode import ASK, TOOLS, Call, CallIds, assembled_message, assert_recovered, run_episode, session_base
from starlette.testclient import TestClient

from support.stack import Stack

MODEL = "m"
CONFIG = {"key": "", "default_proxy": {"model_name": MODEL, "train": {"temperature": 1.0},
                                       "val": {"temperature": 0.0}}}


@contextlib.contextmanager
def agl_server(endpoint: str, rollout_id: str) -> Iterator[TestClient]:
    """agent-lightning's app with `endpoint` as the one server of its model and one rollout enqueued."""
    with TestClient(create_app(CONFIG)) as client:
        assert client.delete("/api/models").status_code == 200  # its model registry is module state
        assert client.post("/api/models", json=[{"model": MODEL, "endpoint": endpoint}]).status_code == 201
        assert client.post("/api/rollouts", json=[{"input": {}, "rollout_id": rollout_id}]).status_code == 201
        yield client


def test_triplet_events_hold_the_sessions_ids(trainer_stack: Stack) -> None:
    rollout_id = f"r-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        clients: dict[str, TestClient] = {}

        def call_for(sid: str) -> Call:
            http = clients["agl"] = stack.enter_context(agl_server(session_base(trainer_stack.server, sid), rollout_id))
            sdk = openai.OpenAI(base_url=f"{http.base_url}/proxy/rollout/{rollout_id}/attempt/{DEFAULT_ATTEMPT_ID}"
                                         "/mode/train/openai/v1", api_key="x", http_client=http, max_retries=0)

            def call(messages: list[dict[str, Any]]) -> dict[str, Any]:
                completion = sdk.chat.completions.create(model="agent", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
                return completion.choices[0].message.model_dump(exclude_none=True)

            return call

        stored = run_episode(trainer_stack.server, call_for)
        events = clients["agl"].get(f"/api/rollouts/{rollout_id}/events",
                                    params={"format": "triplet", "event_type": "model_request"}).json()
    assert all(e["data"]["status"] == "ok" for e in events)
    assert_recovered(stored, [CallIds(e["data"]["prompt_token_ids"], e["data"]["response_token_ids"],
                                      e["data"]["response_log_probs"]) for e in events])


def test_streamed_chunks_read_as_the_sessions_ids(trainer_stack: Stack) -> None:
    def call_for(sid: str) -> Call:
        sdk = openai.OpenAI(base_url=session_base(trainer_stack.server, sid), api_key="x", max_retries=0)

        def call(messages: list[dict[str, Any]]) -> dict[str, Any]:
            chunks = [c.model_dump() for c in sdk.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, stream=True, extra_body=ASK)]  # type: ignore[arg-type]
            read.append(_trim_model_request({"response": chunks}))
            return assembled_message(chunks)

        return call

    read: list[dict[str, Any]] = []
    stored = run_episode(trainer_stack.server, call_for)
    assert_recovered(stored, [CallIds(r["prompt_token_ids"], r["response_token_ids"], None) for r in read],
                     logprobs=False)

