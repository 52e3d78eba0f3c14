"""The real `smg` gateway (PyPI smg 1.13.0, sglang-router's successor) in front of two `sglang-sim` workers, with the
session server behind it. The feature matrix, each entry proven here:

- session affinity: `x-smg-routing-key` (the server sends its session id) is sticky under `manual` (with
  `--assignment-mode min_load`), `consistent_hashing`, and `round_robin` with `--routing-key-override`: every turn
  of a session reaches one worker.
- routed experts: smg forwards `/generate` bodies with unknown fields intact (it adds its defaults), so
  `--return-routed-experts` works and samples carry them. Streams pass through chunk by chunk.
- abort: `/abort_request` is 404 through smg; the server then closes the /generate connection, smg drops its
  upstream request and the worker frees the KV at once.
- engine sessions: `/open_session` and `/close_session` are 404: `--engine-sessions` is refused at startup, with the
  reason, in one line.
- pause for weight updates: `/pause_generation` and `/continue_generation` are 404; with `--enable-rl`,
  `POST /v1/rl/engine/{path}?selector=engine=sglang` reaches every worker with the body unchanged and
  `/v1/rl/workers/{id}/engine/{path}` one of them (the trainer's path; the server's own `/admin/pause` needs none).
- behind smg `--enable-rl` the server sends its control calls through that fan-out (session_server/engine/routers.py):
  `--engine-sessions` works (each engine session open on every worker, the turns on one), an abort reaches the worker
  by its rid, and `/admin/pause` `in_place` pauses every worker.
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from harness.launchers import RunningProcess, start_session_server, start_smg
from support.server import assert_engine_baseline, chat_url, engine_info, new_session, sse_events
from support.sim import wait_for
from support.stack import FleetFactory
from trajectory import samples_from_json

FAMILY = "qwen3"
LAYERS, TOP_K = 2, 2
# An abort grace longer than any machine takes to free KV, so only the grace itself can reach it.
LONG_GRACE = ("--abort-grace", "60")
LONG_CHAT = {"messages": [{"role": "user", "content": "slow [[sim: tokens 12000]]"}]}  # 60 s unless aborted
POLICIES = {
    "manual": ("--policy", "manual", "--assignment-mode", "min_load"),
    "consistent_hashing": ("--policy", "consistent_hashing"),
    "round_robin+override": ("--policy", "round_robin", "--routing-key-override"),
}


@dataclass
class Gateway:
    smg: RunningProcess
    server: RunningProcess


@dataclass
class SmgStack:
    sims: list[str]
    tok: Path
    gateways: dict[str, Gateway]
    rl: RunningProcess
    rl_server: RunningProcess  # --engine-sessions --return-routed-experts, behind `rl`


@pytest.fixture(scope="module")
def stack(fleet_factory: FleetFactory, tokenizer_dirs: dict[str, Path]) -> Iterator[SmgStack]:
    sim_args = ["--model-path", str(tokenizer_dirs[FAMILY]), "--token-latency-ms", "5", "--enable-streaming-session",
                "--routed-experts-layers", str(LAYERS), "--routed-experts-top-k", str(TOP_K)]
    with fleet_factory(family=FAMILY, sim_args=sim_args) as f:
        gateways = {}
        for name, args in POLICIES.items():
            # `--policy` is given in args; start_smg's default is overridden by the later flag.
            gw = f.start(start_smg(f.urls, *args, log_path=f.logs / f"smg-{name}.log"))
            server = f.start(start_session_server(gw.url, f.tok, FAMILY, "--return-routed-experts", *LONG_GRACE,
                                                  name=f"server-{name}", log_dir=f.logs))
            gateways[name] = Gateway(gw, server)
        rl = f.start(start_smg(f.urls, "--enable-rl", log_path=f.logs / "smg-rl.log"))
        rl_server = f.start(start_session_server(rl.url, f.tok, FAMILY, "--engine-sessions", "--return-routed-experts",
                                                 name="server-rl", log_dir=f.logs))
        yield SmgStack(f.urls, f.tok, gateways, rl, rl_server)


def _totals(sims: list[str]) -> tuple[int, int]:
    infos = [engine_info(s) for s in sims]
    return sum(i["routing_keys"] for i in infos), sum(i["finished_requests"] for i in infos)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_turn_of_a_session_reaches_one_worker(stack: SmgStack, policy: str) -> None:
    server = stack.gateways[policy].server.url
    keys0, finished0 = _totals(stack.sims)
    sessions = [new_session(server) for _ in range(6)]
    histories: dict[str, list[dict[str, str]]] = {sid: [] for sid in sessions}
    for turn in range(3):
        for sid in sessions:
            history = histories[sid]
            history.append({"role": "user", "content": f"turn {turn} [[sim: tokens 3]]"})
            r = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=60)
            assert r.status_code == 200, r.text
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    keys, finished = _totals(stack.sims)
    assert keys - keys0 == len(sessions)  # a session split over both workers would count twice
    assert finished - finished0 == 3 * len(sessions)
    for sid in sessions:
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_routed_experts_and_streams_pass_through(stack: SmgStack) -> None:
    server = stack.gateways["manual"].server.url
    sid = new_session(server)
    history: list[dict[str, str]] = []
    for turn in range(2):
        history.append({"role": "user", "content": f"turn {turn} [[sim: tokens 5]]"})
        r = httpx.post(chat_url(server, sid), json={"messages": history, "stream": turn == 1}, timeout=60)
        assert r.status_code == 200, r.text
        if turn == 1:
            events = sse_events(r.content)
            # The server may batch the engine's events (engine/http11.EngineStream), so at least content and the end.
            assert len(events) >= 2 and events[-1]["choices"][0]["finish_reason"] == "stop"
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        else:
            content = r.json()["choices"][0]["message"]["content"]
        history.append({"role": "assistant", "content": content})
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}).json())[0]
    assert sample.routed_experts is not None and sample.routed_experts.shape == (len(sample.tokens), LAYERS * TOP_K)
    assert np.all(sample.routed_experts[:-1] >= 0)  # every position but the last one was routed by the engine
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


def test_abort_closes_the_connection_and_the_worker_frees_its_kv(stack: SmgStack) -> None:
    gw = stack.gateways["manual"]
    sid = new_session(gw.server.url)

    def running() -> bool:
        return any(engine_info(s)["running_requests"] for s in stack.sims)

    async def main() -> tuple[int, int, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(gw.server.url, sid), json=LONG_CHAT))
            await asyncio.to_thread(wait_for, running, 20)
            t0 = time.monotonic()
            deleted = await http.delete(f"{gw.server.url}/sessions/{sid}")
            status = (await chat).status_code
            await asyncio.to_thread(wait_for, lambda: not running(), 20)
            return deleted.status_code, status, time.monotonic() - t0

    deleted, chat_status, freed_after = asyncio.run(main())
    assert (deleted, chat_status) == (204, 404)
    # not the 60 s abort grace (at least 60 s: a timer never fires early): smg passed the disconnect on
    assert freed_after < 20.0, freed_after
    for sim in stack.sims:
        assert_engine_baseline(sim)


def test_startup_refuses_engine_sessions_behind_smg(stack: SmgStack) -> None:
    code = "import sys; from session_server.cli import main; sys.exit(main())"
    args = ["--engine-url", stack.gateways["manual"].smg.url, "--tokenizer", str(stack.tok), "--model-family", FAMILY,
            "--port", "0", "--engine-sessions"]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "is a router" in out.stderr and "--engine-sessions" in out.stderr and "/open_session" in out.stderr
    assert out.stderr.count("\n") == 1  # one line, no traceback


def test_engine_control_paths_are_404_but_the_rl_fan_out_reaches_every_worker(stack: SmgStack) -> None:
    plain = stack.gateways["manual"].smg.url
    for path in ("/abort_request", "/open_session", "/close_session", "/pause_generation", "/continue_generation"):
        assert httpx.post(plain + path, json={}, timeout=10).status_code == 404, path
    fan_out = f"{stack.rl.url}/v1/rl/engine/{{}}?selector=engine=sglang"
    r = httpx.post(fan_out.format("pause_generation"), json={"mode": "abort"}, timeout=10)
    assert r.status_code == 200 and r.json()["succeeded"] == len(stack.sims), r.text
    assert all(engine_info(s)["paused"] for s in stack.sims)
    r = httpx.post(fan_out.format("continue_generation"), json={}, timeout=10)
    assert r.status_code == 200 and r.json()["succeeded"] == len(stack.sims), r.text
    assert not any(engine_info(s)["paused"] for s in stack.sims)
    # One worker at a time: /v1/rl/workers names them, /v1/rl/workers/{id}/engine/{path} reaches one.
    workers = httpx.get(f"{stack.rl.url}/v1/rl/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(stack.sims)
    target = workers[0]
    r = httpx.post(f"{stack.rl.url}/v1/rl/workers/{target['id']}/engine/open_session",
                   json={"capacity_of_str_len": 64, "streaming": True, "timeout": 30, "session_id": "one"}, timeout=10)
    assert r.status_code == 200, r.text
    assert [engine_info(s)["open_sessions"] for s in stack.sims] == [int(s == target["url"]) for s in stack.sims]
    r = httpx.post(f"{stack.rl.url}/v1/rl/workers/{target['id']}/engine/close_session", json={"session_id": "one"},
                   timeout=10)
    assert r.status_code == 200, r.text
    wait_for(lambda: all(engine_info(s)["open_sessions"] == 0 for s in stack.sims), 60)


def test_the_b64_shape_through_smg_is_the_engines(stack: SmgStack) -> None:
    """smg adds defaults to the body it forwards but keeps `return_routed_experts` and its start: the reply's payload
    covers exactly the positions asked for."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(stack.tok)("hello [[sim: tokens 4]]")["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8}, "return_routed_experts": True,
            "routed_experts_start_len": 3, "rid": "b64-shape"}
    r = httpx.post(stack.gateways["manual"].smg.url + "/generate", json=body, headers={"x-smg-routing-key": "k"},
                   timeout=30)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    rows = len(base64.b64decode(meta["routed_experts"])) // (4 * LAYERS * TOP_K)
    assert rows == len(ids) + meta["completion_tokens"] - 1 - 3


def _open_sessions(sims: list[str]) -> list[int]:
    return [engine_info(s)["open_sessions"] for s in sims]


def test_behind_smg_rl_engine_sessions_aborts_and_pause_go_through_the_fan_out(stack: SmgStack) -> None:
    server = stack.rl_server
    wait_for(lambda: httpx.get(f"{server.url}/ready", timeout=10).json()["engines"][0]["kind"] == "smg --enable-rl", 30)
    sid = new_session(server.url)
    history: list[dict[str, str]] = []
    for turn in range(3):
        history.append({"role": "user", "content": f"turn {turn} [[sim: tokens 3]]"})
        r = httpx.post(chat_url(server.url, sid), json={"messages": history}, timeout=60)
        assert r.status_code == 200, r.text
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        # opened at the second turn (the first has nothing to reuse), under the server's id on every worker
        assert _open_sessions(stack.sims) == [int(turn > 0)] * 2
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the third turn appended to it

    def running() -> bool:
        return any(engine_info(s)["running_requests"] for s in stack.sims)

    async def abort() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server.url, sid), json=LONG_CHAT))
            await asyncio.to_thread(wait_for, running, 20)
            deleted = await http.delete(f"{server.url}/sessions/{sid}")
            return deleted.status_code, (await chat).status_code

    assert asyncio.run(abort()) == (204, 404)
    wait_for(lambda: not running() and _open_sessions(stack.sims) == [0, 0], 60)
    assert not any("abort of rid" in line for line in server.output), server.tail()  # acknowledged, not 404
    assert httpx.post(f"{server.url}/admin/pause", json={"mode": "in_place"}, timeout=10).status_code == 200
    assert all(engine_info(s)["paused"] for s in stack.sims)
    assert httpx.post(f"{server.url}/admin/continue", json={}, timeout=10).status_code == 200
    assert not any(engine_info(s)["paused"] for s in stack.sims)
    for sim in stack.sims:
        assert_engine_baseline(sim)
