"""An invariant broken at commit: 500, an error log naming the session, nothing committed, the slot released.

This cannot be provoked through the public API (that is the point of an invariant), so the app runs in-process
(Starlette's TestClient, real lifespan) against a real `sglang-sim`, with `LinearTrajectory.commit` sabotaged once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from session_server.app import build_app
from session_server.config import ServerConfig
from support.stack import StackFactory
from trajectory import LinearTrajectory, get_family
from trajectory.errors import InvariantError

FAMILY = "qwen3"
CHAT = {"messages": [{"role": "user", "content": "hi [[sim: tokens 3]]"}]}


@pytest.fixture(scope="module")
def engine(stack_factory: StackFactory) -> Iterator[str]:
    with stack_factory(family=FAMILY, servers={}) as stack:
        yield stack.engine


def test_invariant_error_at_commit_is_500_and_logged(
    engine: str, tokenizer_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    family = get_family(FAMILY, AutoTokenizer.from_pretrained(tokenizer_dirs[FAMILY]))
    config = ServerConfig(engine_url=engine, tokenizer=str(tokenizer_dirs[FAMILY]), model_family=FAMILY)
    real_stage = LinearTrajectory.stage

    def broken_commit(self: LinearTrajectory, *args: object, **kwargs: object) -> object:
        raise InvariantError("stored ids are not a prefix of the prompt (sabotaged)")

    with TestClient(build_app(config, family)) as client:
        sid = client.post("/sessions").json()["session_id"]
        monkeypatch.setattr(LinearTrajectory, "stage", broken_commit)  # the validating half of every commit
        with caplog.at_level(logging.ERROR, logger="session_server"):
            resp = client.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT)
        assert resp.status_code == 500
        assert resp.json()["error"]["code"] == "invariant_violation"
        assert any(sid in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
        assert client.get(f"/sessions/{sid}").json()["records"] == []
        monkeypatch.setattr(LinearTrajectory, "stage", real_stage)
        assert client.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT).status_code == 200
        assert client.delete(f"/sessions/{sid}").status_code == 204
