"""engine/routers.py: smg's RL fan-out replies read as one engine's (shapes captured from smg 1.13.0 in front of two
real SGLang 0.5.23 engines), and the startup refusal of what each router breaks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from session_server.engine.routers import BROKEN, EngineKind, fan_out_path, refusal, unpack_fan_out


def _aggregate(*answers: tuple[int, Any]) -> bytes:
    results = {f"w{i}": {"worker_id": f"w{i}", "url": f"http://e{i}", "status": status, "latency_ms": 3, "body": body}
               for i, (status, body) in enumerate(answers)}
    failed = [{"worker_id": f"w{i}", "error": "upstream_error", "message": f"HTTP {s}", "status": s}
              for i, (s, _) in enumerate(answers) if s >= 300]
    return json.dumps({"results": results, "failed": failed, "total": len(answers),
                       "succeeded": len(answers) - len(failed)}).encode()


def test_the_fan_out_path_names_every_sglang_engine() -> None:
    assert fan_out_path("/abort_request") == "/v1/rl/engine/abort_request?selector=engine=sglang"


def test_every_engine_answering_is_one_engine_answering() -> None:
    # /abort_request and /close_session: SGLang's empty 200 stays empty.
    assert unpack_fan_out(200, _aggregate((200, ""), (200, ""))) == (200, b"")
    # /open_session: the id each engine returned, as SGLang's JSON string.
    assert unpack_fan_out(200, _aggregate((200, "s1"), (200, "s1"))) == (200, b'"s1"')
    status, body = unpack_fan_out(200, _aggregate((200, {"status": "ok"}), (200, {"status": "ok"})))
    assert (status, json.loads(body)) == (200, {"status": "ok"})


def test_one_engine_failing_is_the_call_failing() -> None:
    error = {"error": {"message": "Failed to open the session. Check if a session with the same id is still open."}}
    status, body = unpack_fan_out(207, _aggregate((200, "s1"), (400, error)))
    assert (status, json.loads(body)) == (400, error)


@pytest.mark.parametrize(("status", "body"), [
    (400, b'{"error":"selector_required","message":"a non-empty `selector` query parameter is required"}'),
    (502, b"upstream down"),
    (200, b'{"results": {}}'),
])
def test_a_reply_that_reached_no_engine_is_an_error(status: int, body: bytes) -> None:
    got_status, got_body = unpack_fan_out(status, body)
    assert got_status >= 400 and got_body == body


@pytest.mark.parametrize("kind", [EngineKind.SGLANG_ROUTER, EngineKind.SMG])
def test_refusal_names_the_router_the_flag_and_why(kind: EngineKind) -> None:
    for flag, why in BROKEN[kind].items():
        msg = refusal({"http://r": kind}, engine_sessions=flag == "--engine-sessions",
                      return_routed_experts=flag == "--return-routed-experts")
        assert msg is not None and "http://r is a router" in msg and flag in msg and why in msg and str(kind) in msg


def test_what_works_is_not_refused() -> None:
    both = {"engine_sessions": True, "return_routed_experts": True}
    assert refusal({"http://e": EngineKind.ENGINE, "http://s": EngineKind.SMG_RL}, **both) is None
    assert refusal({"http://s": EngineKind.SMG}, engine_sessions=False, return_routed_experts=True) is None
    assert refusal({"http://r": EngineKind.SGLANG_ROUTER}, engine_sessions=False, return_routed_experts=False) is None
    msg = refusal({"http://r": EngineKind.SGLANG_ROUTER}, **both)
    assert msg is not None and msg.count("is a router") == 2
