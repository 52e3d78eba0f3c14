"""A streamed turn on a lost engine session, against released SGLang 0.5.23 (issue 31): reopened, as a plain one is.

With `--engine-sessions` an engine that restarted between two turns no longer has the trajectory's streaming
session. A plain request naming it gets SGLang's 400 "session id ... does not exist" and the server reopens the
session and resends the whole prompt. A streamed one gets the same refusal as a final event, HTTP 200 with an abort
that carries `status_code: 400` (tokenizer_manager.py `_handle_abort_finish_reason`): before the one engine call
(session_server/turns/engine_call.py) the streamed turn failed there with 502 -- what Codex CLI and Claude Code, which
stream every turn, would have met. Here the engine restarts between two turns and the next one streams; and, without
the cost of a restart, the engine session is closed behind the server's back (what a restart loses) before a
streamed turn of each API. The fault comes after two turns: the first opens no engine session (it has nothing to
reuse), the second opens the one the third then finds gone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import metric, new_session
from support.sglang_engine import Engines, Served, ServeFactory, assert_engine_clean

REOPENS = "session_server_engine_session_reopens_total"
TEXTS = ("Hello there.", "Go on.", "Tell me more.")
PATHS = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense", "--engine-sessions") as s:
        yield s


def _body(api: str, stream: bool, before: list[dict[str, Any]]) -> dict[str, Any]:
    """The turn after `before` (the earlier turns' replies as the API returned them), continuing them."""
    sampling = {"temperature": 0, "stream": stream}
    text, earlier = TEXTS[len(before)], list(zip(TEXTS, before, strict=False))
    if api == "chat":
        history = [m for t, r in earlier for m in ({"role": "user", "content": t}, r["choices"][0]["message"])]
        return {"messages": [*history, {"role": "user", "content": text}], "max_tokens": 6, **sampling}
    if api == "responses":
        chained = {"previous_response_id": before[-1]["id"]} if before else {}
        return {"model": "m", "input": text, "max_output_tokens": 6, **chained, **sampling}
    history = [m for t, r in earlier for m in ({"role": "user", "content": t},
                                               {"role": "assistant", "content": r["content"]})]
    return {"model": "m", "messages": [*history, {"role": "user", "content": text}], "max_tokens": 6, **sampling}


def _streamed_ok(api: str, body: bytes) -> None:
    """The stream ended as a whole reply: no error event, and the API's closing event."""
    events = [json.loads(line[5:]) for line in body.split(b"\n") if line.startswith(b"data:")
              and line[5:].strip() != b"[DONE]"]
    if api == "chat":
        assert not [e for e in events if "error" in e], events
        assert events[-1]["choices"][0]["finish_reason"] is not None, events[-1]
    elif api == "responses":  # completed, or incomplete at max_output_tokens: not failed
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    else:
        assert events[-1]["type"] == "message_stop", events[-1]


def _turn(served: Served, sid: str, api: str, stream: bool, before: list[dict[str, Any]]) -> dict[str, Any] | None:
    url = f"{served.server}/sessions/{sid}/v1/{PATHS[api]}"
    with httpx.stream("POST", url, json=_body(api, stream, before), timeout=300) as r:
        body = r.read()
    assert r.status_code == 200, body
    if stream:
        _streamed_ok(api, body)
        return None
    return json.loads(body)


def _records(served: Served, sid: str) -> list[dict[str, Any]]:
    return httpx.get(f"{served.server}/sessions/{sid}", timeout=10).json()["records"]


def _two_turns(served: Served, sid: str, api: str) -> list[dict[str, Any]]:
    """Two plain turns, the second opening the engine session; their replies."""
    replies: list[dict[str, Any]] = []
    for _ in range(2):
        reply = _turn(served, sid, api, False, replies)
        assert reply is not None
        replies.append(reply)
    return replies


def _third_turn_reopens(served: Served, sid: str, api: str, before: list[dict[str, Any]]) -> None:
    """The third turn, streamed: 200 and whole, after one reopen and the whole prompt resent; the session is
    deleted whatever happened (the engine is shared)."""
    try:
        reopens = metric(served.server, REOPENS, 0.0)
        served.proxy.clear()
        _turn(served, sid, api, True, before)
        assert metric(served.server, REOPENS, 0.0) == reopens + 1
        generates = [c for c in served.proxy.settled() if c["path"] == "/generate"]
        seen = [(g["request"].get("rid"), g["request"].get("session_params"), g["request"]["stream"],
                 g["request"]["sampling_params"].get("max_new_tokens"), len(g["request"]["input_ids"]),
                 g.get("status"), str(g.get("response"))[:300]) for g in generates]
        assert len(generates) == 2 and all(g["request"]["stream"] for g in generates), seen
        refused, resent = generates
        assert len(resent["request"]["input_ids"]) > len(refused["request"]["input_ids"])  # the whole prompt again
        records = _records(served, sid)
        assert len(records) == 3 and records[2]["prompt_len"] > records[1]["prompt_len"]
    finally:
        assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204


@pytest.mark.parametrize("api", sorted(PATHS))
def test_a_streamed_turn_reopens_an_engine_session_closed_behind_the_servers_back(served: Served, api: str) -> None:
    sid = new_session(served.server)
    served.proxy.clear()
    before = _two_turns(served, sid, api)
    (opened,) = [c for c in served.proxy.settled() if c["path"] == "/open_session"]
    closed = httpx.post(f"{served.engine}/close_session", json={"session_id": opened["response"]}, timeout=30)
    assert closed.status_code == 200, closed.text
    _third_turn_reopens(served, sid, api, before)
    assert_engine_clean(served.engine)


def test_a_streamed_turn_after_an_engine_restart_reopens_its_engine_session(served: Served, engines: Engines) -> None:
    sid = new_session(served.server)
    before = _two_turns(served, sid, "chat")
    engine = engines.get("dense")
    engines.start("dense", port=engine.port)  # back where the server and its proxy expect it, with no sessions
    _third_turn_reopens(served, sid, "chat", before)
    assert_engine_clean(served.engine)
