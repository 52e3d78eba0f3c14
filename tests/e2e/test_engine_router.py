"""The real `sglang-router` 0.3.2 in front of two `sglang-sim` workers, with the session server behind it.

What is proven: under `--policy manual` the router keeps every session on one worker (the server sends its session id
as `X-SMG-Routing-Key`); an abort, which the router answers 404, still frees the worker's KV at once because the server
closes the /generate connection instead of waiting its grace (5 s by default, 60 s here); and the features the router
breaks (`--engine-sessions`, `--return-routed-experts`) are refused at startup with an error that says why.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.launchers import RunningProcess, free_port, start_router, start_session_server, wait_router
from support.server import assert_engine_baseline, chat_url, engine_info, new_session
from support.sim import wait_for
from support.stack import FleetFactory

FAMILY = "qwen3"
TOKEN_MS = 5
# An abort grace longer than any machine takes to free KV, so only the grace itself can reach it.
LONG_GRACE = ("--abort-grace", "60")
LONG_CHAT = {"messages": [{"role": "user", "content": "slow [[sim: tokens 12000]]"}]}  # 60 s unless aborted


@dataclass
class RouterStack:
    sims: list[str]
    router: str
    server: str
    server_proc: RunningProcess
    tok: Path


@pytest.fixture(scope="module")
def stack(fleet_factory: FleetFactory, tokenizer_dirs: dict[str, Path]) -> Iterator[RouterStack]:
    # The router registers a tokenizer from the model_path each worker reports: it must be a tokenizer directory.
    sim_args = ["--model-path", str(tokenizer_dirs[FAMILY]), "--token-latency-ms", str(TOKEN_MS)]
    with fleet_factory(family=FAMILY, sim_args=sim_args) as f:
        # Its metrics exporter binds a fixed port (29000) on every interface unless told: a free loopback one.
        metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        router = f.start(start_router(f.urls, *metrics, log_dir=f.logs, wait=False))
        wait_router(router, len(f.urls))
        server = f.start(start_session_server(router.url, f.tok, FAMILY, *LONG_GRACE, log_dir=f.logs))
        yield RouterStack(f.urls, router.url, server.url, server, f.tok)


def _keys_and_finished(sims: list[str]) -> tuple[int, int]:
    infos = [engine_info(s) for s in sims]
    return sum(i["routing_keys"] for i in infos), sum(i["finished_requests"] for i in infos)


def test_manual_policy_keeps_each_session_on_one_worker(stack: RouterStack) -> None:
    keys0, finished0 = _keys_and_finished(stack.sims)
    sessions = [new_session(stack.server) for _ in range(6)]
    histories: dict[str, list[dict[str, str]]] = {sid: [] for sid in sessions}
    for turn in range(2):
        for sid in sessions:
            history = histories[sid]
            history.append({"role": "user", "content": f"turn {turn} [[sim: tokens 3]]"})
            r = httpx.post(chat_url(stack.server, sid), json={"messages": history}, timeout=60)
            assert r.status_code == 200, r.text
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    keys, finished = _keys_and_finished(stack.sims)
    # Each session id reached exactly one worker (a session split over both would count twice).
    assert keys - keys0 == len(sessions)
    assert finished - finished0 == 2 * len(sessions)
    for sid in sessions:
        assert httpx.delete(f"{stack.server}/sessions/{sid}").status_code == 204
    for sim in stack.sims:
        assert_engine_baseline(sim)


def test_abort_behind_router_closes_the_connection_and_frees_kv_at_once(stack: RouterStack) -> None:
    sid = new_session(stack.server)

    def running() -> bool:
        return any(engine_info(s)["running_requests"] for s in stack.sims)

    async def main() -> tuple[int, int, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(stack.server, sid), json=LONG_CHAT))
            await asyncio.to_thread(wait_for, running, 20)
            t0 = time.monotonic()
            deleted = await http.delete(f"{stack.server}/sessions/{sid}")
            status = (await chat).status_code
            await asyncio.to_thread(wait_for, lambda: not running(), 20)
            return deleted.status_code, status, time.monotonic() - t0

    deleted, chat_status, freed_after = asyncio.run(main())
    assert (deleted, chat_status) == (204, 404)
    # The router answered /abort_request 404; waiting the grace (60 s here, and a timer never fires early) would hold
    # the worker's KV that long, while closing at once frees it in well under a second: 20 s separates the two on any
    # machine.
    assert freed_after < 20.0, freed_after
    assert any("abort of rid" in line for line in stack.server_proc.output), stack.server_proc.tail()
    for sim in stack.sims:
        assert_engine_baseline(sim)


def _serve(router: str, tok: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from session_server.cli import main; sys.exit(main())"
    args = ["--engine-url", router, "--tokenizer", str(tok), "--model-family", FAMILY, "--port", "0", *flags]
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("flag", "why"),
    [("--engine-sessions", "/open_session"), ("--return-routed-experts", "return_routed_experts")],
)
def test_startup_refuses_what_the_router_breaks(stack: RouterStack, flag: str, why: str) -> None:
    out = _serve(stack.router, stack.tok, flag)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "is a router" in out.stderr and flag in out.stderr and why in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1  # one line, no traceback


def test_ready_and_models_through_the_router(stack: RouterStack) -> None:
    ready = httpx.get(f"{stack.server}/ready", timeout=10)
    assert ready.status_code == 200, ready.text
    assert [e["url"] for e in ready.json()["engines"]] == [stack.router]
