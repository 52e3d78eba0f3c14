"""Two `--engine-url` workers (data-parallel sims) behind one session server that places sessions itself.

Proven here: sessions spread over the workers by live-session count and stay on theirs (every /generate and engine
session of a session reaches one worker); an abort goes to the worker that runs the request and is acknowledged there;
engine sessions live on the session's worker; and when a worker dies its sessions move on their next turn
(re-prefilled, engine session reopened on the survivor), counted in /metrics, with nothing left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.launchers import start_session_server
from support.server import assert_engine_baseline, chat_url, engine_info, new_session
from support.sim import wait_for
from support.stack import Fleet, FleetFactory

FAMILY = "qwen3"
TOKEN_MS = 5
# An abort grace longer than any machine takes to end an acknowledged abort, so only the grace itself can reach it.
LONG_GRACE = ("--abort-grace", "60")
LONG_CHAT = {"messages": [{"role": "user", "content": "slow [[sim: tokens 12000]]"}]}  # 60 s unless aborted


@contextlib.contextmanager
def fleet(fleet_factory: FleetFactory, *server_args: str) -> Iterator[Fleet]:
    """Two sims, and one session server in front of both (`fleet.server`)."""
    sim_args = ["--enable-streaming-session", "--token-latency-ms", str(TOKEN_MS)]
    with fleet_factory(family=FAMILY, sim_args=sim_args) as f:
        urls = [flag for url in f.urls for flag in ("--engine-url", url)]
        f.server = f.start(start_session_server(urls[1], f.tok, FAMILY, *urls[2:], *server_args, log_dir=f.logs)).url
        yield f


@pytest.fixture(scope="module")
def two(fleet_factory: FleetFactory) -> Iterator[Fleet]:
    with fleet(fleet_factory, "--engine-sessions", *LONG_GRACE) as f:
        yield f


def _chat(server: str, sid: str, history: list[dict[str, str]], text: str) -> httpx.Response:
    history.append({"role": "user", "content": f"{text} [[sim: tokens 3]]"})
    r = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=60)
    if r.status_code == 200:
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    else:
        history.pop()
    return r


def _metric(server: str, name: str) -> float:
    for line in httpx.get(f"{server}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_sessions_spread_by_count_and_stay_on_their_worker(two: Fleet) -> None:
    sessions = [new_session(two.server) for _ in range(4)]
    histories: dict[str, list[dict[str, str]]] = {sid: [] for sid in sessions}
    for turn in range(3):
        for sid in sessions:
            assert _chat(two.server, sid, histories[sid], f"turn {turn}").status_code == 200
    infos = [engine_info(u) for u in two.urls]
    # Fewest live sessions first: two each; each session id reached one worker only, with its one engine session.
    assert [i["routing_keys"] for i in infos] == [2, 2], infos
    assert [i["open_sessions"] for i in infos] == [2, 2], infos
    assert [i["finished_requests"] for i in infos] == [6, 6], infos
    ready = httpx.get(f"{two.server}/ready", timeout=10).json()
    assert ready["status"] == "ready"
    assert [(e["url"], e["healthy"], e["sessions"]) for e in ready["engines"]] == [(u, True, 2) for u in two.urls]
    for sid in sessions:
        assert httpx.delete(f"{two.server}/sessions/{sid}").status_code == 204
    assert [e["sessions"] for e in httpx.get(f"{two.server}/ready").json()["engines"]] == [0, 0]
    for url in two.urls:
        assert_engine_baseline(url)


def test_abort_goes_to_the_worker_running_the_request(two: Fleet) -> None:
    sid = new_session(two.server)
    aborted0 = [engine_info(u)["aborted_requests"] for u in two.urls]

    def running() -> list[int]:
        return [engine_info(u)["running_requests"] for u in two.urls]

    async def main() -> tuple[int, int, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(two.server, sid), json=LONG_CHAT))
            await asyncio.to_thread(wait_for, lambda: any(running()), 20)
            t0 = time.monotonic()
            deleted = await http.delete(f"{two.server}/sessions/{sid}")
            return deleted.status_code, (await chat).status_code, time.monotonic() - t0

    deleted, status, took = asyncio.run(main())
    assert (deleted, status) == (204, 404)
    assert took < 20.0, took  # acknowledged by the engine, not dropped after the 60 s grace (a timer never fires early)
    aborted = [engine_info(u)["aborted_requests"] - a for u, a in zip(two.urls, aborted0, strict=True)]
    assert sorted(aborted) == [0, 1], aborted
    for url in two.urls:
        assert_engine_baseline(url)


def test_pause_abort_reaches_every_worker(two: Fleet) -> None:
    sessions = [new_session(two.server) for _ in range(2)]  # one on each worker (both are empty)
    aborted0 = [engine_info(u)["aborted_requests"] for u in two.urls]

    async def main() -> tuple[list[int], int]:
        async with httpx.AsyncClient(timeout=60) as http:
            chats = [asyncio.ensure_future(http.post(chat_url(two.server, sid), json=LONG_CHAT)) for sid in sessions]
            await asyncio.to_thread(
                wait_for, lambda: all(engine_info(u)["running_requests"] == 1 for u in two.urls), 20
            )
            paused = await http.post(f"{two.server}/admin/pause", json={"mode": "abort"})
            statuses = [(await c).status_code for c in chats]
            assert (await http.post(f"{two.server}/admin/continue")).status_code == 200
            return statuses, paused.status_code

    statuses, paused = asyncio.run(main())
    assert paused == 200 and statuses == [503, 503]
    assert [engine_info(u)["aborted_requests"] - a for u, a in zip(two.urls, aborted0, strict=True)] == [1, 1]
    for sid in sessions:
        assert httpx.delete(f"{two.server}/sessions/{sid}").status_code == 204
    for url in two.urls:
        assert_engine_baseline(url)


def test_a_dead_worker_s_sessions_move_on_their_next_turn(fleet_factory: FleetFactory) -> None:
    with fleet(fleet_factory, "--engine-sessions", "--engine-health-interval", "0.2") as f:
        sessions = [new_session(f.server) for _ in range(4)]
        histories: dict[str, list[dict[str, str]]] = {sid: [] for sid in sessions}
        for text in ("first", "second"):  # the second turn opens each session's engine session
            for sid in sessions:
                assert _chat(f.server, sid, histories[sid], text).status_code == 200
        assert [engine_info(u)["open_sessions"] for u in f.urls] == [2, 2]
        survivor, victim = f.sims
        victim.proc.kill()
        victim.proc.wait(10)
        wait_for(lambda: httpx.get(f"{f.server}/ready", timeout=10).json()["status"] == "degraded", 60)
        ready = httpx.get(f"{f.server}/ready", timeout=10)
        assert ready.status_code == 200  # one worker left: still serving
        assert [e["healthy"] for e in ready.json()["engines"]] == [True, False]
        for sid in sessions:
            r = _chat(f.server, sid, histories[sid], "third")
            assert r.status_code == 200, r.text
        info = engine_info(survivor.url)
        assert info["open_sessions"] == 4, info  # the moved sessions reopened theirs on the survivor
        assert _metric(f.server, "session_server_engine_sessions_moved_total") == 2
        assert _metric(f.server, "session_server_engines_healthy") == 1
        for sid in sessions:
            got = httpx.get(f"{f.server}/sessions/{sid}", timeout=30).json()
            assert len(got["records"]) == 3  # the trajectory is intact across the move
        new = new_session(f.server)
        assert _chat(f.server, new, [], "fresh").status_code == 200  # placed on the healthy worker
        for sid in [*sessions, new]:
            assert httpx.delete(f"{f.server}/sessions/{sid}").status_code == 204
        assert_engine_baseline(survivor.url)
