"""session_server.turns.resume: a turn whose engine request the engine aborted for everyone goes on in a new request.

`Continuation` on its own: which aborts it continues (the engine's abort of everything, within the limit, not a
constrained turn that sampled, not a spent budget), and what the next request asks for (prompt + the tokens sampled
so far, the budget reduced by them, the turn's own params untouched). Then in a turn on the real app in process
(tests/support/turn_engine.py): the continuation re-prefills prompt + partial reply under a new rid, the agent gets
one reply, and the committed turn keeps every token with the weight version that sampled it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from session_server.errors import EngineAbortedError
from session_server.turns.resume import Continuation
from support.bounded import bounded, user
from support.inprocess_app import client_of
from support.tito import engine_body
from support.turn_engine import ABORTED_BY_ENGINE, reply_body, start_chat, turn_app
from trajectory import GenerateResult, ModelFamily, decode_generate_response

VOCAB = 1000


def partial(ids: list[int], finish: dict[str, Any] | None = None) -> GenerateResult:
    """What an aborted engine request sampled (`finish`: its abort; the engine's abort of everything unless said)."""
    body = engine_body(ids, finish=finish or ABORTED_BY_ENGINE, prompt_tokens=4, text="x" * len(ids))
    return decode_generate_response(json.dumps(body).encode(), VOCAB)


@pytest.mark.parametrize(("finish", "continued"), [
    (ABORTED_BY_ENGINE, True),
    ({"type": "abort", "message": "Abort in waiting queue"}, True),
    ({"type": "abort", "message": "Abort before prefill"}, False),  # an abort of this request only (ours: by rid)
    ({"type": "abort", "message": "Aborted", "status_code": 400}, False),  # a refusal carried by an abort
    ({"type": "length", "length": 3}, False),
])
def test_only_the_engines_abort_of_everything_is_continued(finish: dict[str, Any], continued: bool) -> None:
    assert (Continuation(limit=4).refusal({}, partial([5, 6, 7], finish)) is None) is continued
    assert Continuation(limit=4).refusal({}, None) == "foreign"


def test_what_cannot_go_on_says_why() -> None:
    three = partial([5, 6, 7])
    assert Continuation(limit=0).refusal({}, three) == "limit"
    assert Continuation(limit=4).refusal({"json_schema": "{}"}, three) == "constrained"  # the grammar would restart
    assert Continuation(limit=4).refusal({"json_schema": "{}"}, partial([])) is None  # nothing sampled: nothing lost
    assert Continuation(limit=4).refusal({"regex": None}, three) is None  # a key that is None constrains nothing
    assert Continuation(limit=4).refusal({"max_new_tokens": 3}, three) == "budget"
    assert Continuation(limit=4).refusal({"max_new_tokens": 4}, three) is None


def test_going_on_counts_up_to_the_limit_and_keeps_the_last_partial() -> None:
    continuation = Continuation(limit=1)
    first, second = partial([5, 6]), partial([5, 6, 7, 8])
    assert continuation.go_on({}, EngineAbortedError("aborted", 1, first)) == "continued"
    assert (continuation.before, continuation.count) == (first, 1)
    assert continuation.go_on({}, EngineAbortedError("aborted", 1, second)) == "limit"
    assert (continuation.before, continuation.count) == (first, 1)  # a refused one changes nothing


def test_the_next_request_is_prompt_plus_what_was_sampled_with_the_budget_reduced() -> None:
    continuation = Continuation(limit=4)
    prompt = np.array([1, 2, 3, 4], dtype=np.int32)
    params = {"max_new_tokens": 10, "temperature": 0.5}
    assert continuation.request(prompt, params) == (prompt, params)  # before an abort: the turn's own
    continuation.go_on(params, EngineAbortedError("aborted", 1, partial([5, 6, 7])))
    ids, sent = continuation.request(prompt, params)
    assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and ids.dtype == np.int32
    assert sent == {"max_new_tokens": 7, "temperature": 0.5}
    assert params == {"max_new_tokens": 10, "temperature": 0.5}  # the turn's params are not touched
    assert continuation.request(prompt, {"temperature": 0.5})[1] == {"temperature": 0.5}  # no budget: none set


# -- a continuation in a turn ------------------------------------------------------------------------------------


def test_a_continued_turn_reprefills_the_partial_reply_and_keeps_each_tokens_version(family: ModelFamily) -> None:
    async def main() -> None:
        with turn_app(family) as (app, _server, engine, session):
            async with client_of(app) as http:
                turn = start_chat(http, session.id, user("hi"), max_tokens=50)
                first = await engine.next_call()
                cut = reply_body(family, first, "Hello", weight_version="w0", finish=ABORTED_BY_ENGINE)
                first.reply(cut)
                engine.weight_version = "w1"  # the update that cut it: the server asks, keys by it
                second = await engine.next_call()
                assert second.payload["extra_key"] == "weights:w1" != first.payload["extra_key"]
                rest = reply_body(family, second, " there.", weight_version="w1")
                second.reply(rest)
                reply = await bounded(turn)
            sampled, more = cut["output_ids"], rest["output_ids"]
            assert second.input_ids == first.input_ids + sampled and second.rid != first.rid
            assert second.payload["sampling_params"]["max_new_tokens"] == 50 - len(sampled)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello there."
            record = session.trajectory.records[-1]
            n, m = len(sampled), len(more)
            assert session.trajectory.token_ids[-(n + m):].tolist() == sampled + more
            assert record.completion_len == n + m
            assert record.weight_versions == (("w0", 0, n), ("w1", n, n + m))  # the old tokens keep their version
            assert engine.aborted == []  # the engine ended the first request itself

    asyncio.run(main())


def test_an_abort_past_the_limit_is_a_503_and_commits_nothing(family: ModelFamily) -> None:
    async def main() -> None:
        with turn_app(family, max_turn_continuations=0) as (app, _server, engine, session):
            async with client_of(app) as http:
                turn = start_chat(http, session.id, user("hi"))
                first = await engine.next_call()
                first.reply(reply_body(family, first, "Hello", finish=ABORTED_BY_ENGINE))
                reply = await bounded(turn)
            assert reply.status_code == 503 and len(engine.generated) == 1
            assert session.trajectory.version == 0

    asyncio.run(main())
