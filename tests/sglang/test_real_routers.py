"""The real routers in front of two real SGLang engines, with the session server behind each router.

Two SGLang 0.5.23 workers of the tiny MoE model (routed experts on): the run's shared `moe` engine and this module's
own `moe-b`, each behind a recording proxy that passes disconnects on (so each call an engine received is on record:
its body, its routing key, its answer). In front of the two proxies: `sglang-router` 0.3.2 (`--policy manual`), `smg`
1.13.0 (`--policy consistent_hashing`) and `smg --enable-rl` (`--policy manual --assignment-mode min_load`); a session
server behind each, sending its session id as `X-SMG-Routing-Key`. What holds, against the real engines
(session_server/engine/routers.py draws the conclusions):

- every router: multi-turn TITO is exact (the sample is what the engine that served the session received and
  generated), plain and streamed, and every turn of a session reaches one engine;
- every router: a DELETE during a long generation frees the engine's KV. Behind sglang-router and plain smg the abort
  is 404, so the server closes its connection and the router drops its request to the engine (SGLang aborts a request
  whose caller went away); behind smg --enable-rl the abort reaches the engine by its rid through smg's fan-out;
- smg --enable-rl: `--engine-sessions` (each engine session opened and closed on every engine through the fan-out,
  the turns on one; KV reuse in `cached_tokens`), `--return-routed-experts`, and `/admin/pause` `in_place` with a
  weight update through the fan-out in the middle of a streamed reply;
- what the others break is refused: sglang-router drops `return_routed_experts` from the body the engine gets and
  404s the session, abort, pause and weight-update paths, as plain smg does; the server refuses `--engine-sessions` and
  `--return-routed-experts` behind them at startup, and `/admin/pause` `in_place` with a 502 that says why.

The long replies are long by construction: while an abort or a pause must land in the middle of one, both engines run
paced (`paced`, SGLang's own `/slow_down`, PACE seconds per step), so LONG outlasts every bound here on any machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from harness.launchers import RunningProcess, free_port, start_router, start_session_server, start_smg
from support.server import RecordingProxy, assert_sample_is_what_the_engine_saw, chat_url, new_session, sse_events
from support.sglang_engine import Engines, assert_engine_clean, paced, wait_loads
from trajectory import samples_from_json

FAMILY = "qwen3"
ENGINES = ("moe", "moe-b")
LAYERS, TOP_K = 2, 2  # the tiny MoE checkpoint (scripts/build_tiny_checkpoints.py)
GREEDY = {"temperature": 0, "max_tokens": 8}
LONG = {"messages": [{"role": "user", "content": "Write a very long essay."}], "temperature": 0, "max_tokens": 1500}
PACE = 0.2  # seconds per engine step while a test needs a reply under way: LONG takes at least 300 s
SERVER_FLAGS = {
    "sglang-router": (),
    "smg": (),
    # `keep`: the in-place pause test below holds smg's fan-out of SGLang's own in_place mode (the default,
    # `recompute`, cuts running replies with mode abort instead: tests/sglang/test_real_weight_cache_key.py)
    "smg-rl": ("--engine-sessions", "--return-routed-experts", "--straddled-replies", "keep"),
}
ROUTERS = tuple(SERVER_FLAGS)
CONTROL_PATHS = ("/abort_request", "/open_session", "/close_session", "/pause_generation", "/continue_generation",
                 "/update_weights_from_disk", "/update_weight_version")


@dataclass
class Routed:
    engines: list[str]  # the engines' own URLs
    proxies: list[RecordingProxy]  # one per engine, in the same order: what the routers talk to
    routers: dict[str, RunningProcess]
    servers: dict[str, RunningProcess]
    checkpoint: Path

    def generates(self, sid: str, *, settled: bool = True) -> list[list[dict[str, Any]]]:
        """Per engine, the /generate calls of session `sid` it received (`settled`: once each has its answer)."""
        return [[c for c in (p.settled(timeout=60) if settled else list(p.calls))
                 if c["path"] == "/generate" and c["routing_key"] == sid] for p in self.proxies]

    def clear(self) -> None:
        for proxy in self.proxies:
            proxy.clear()


def _wait_kind(server: str) -> str:
    """What the server found at its engine URL (a background probe at its start): wait for it, bounded."""
    deadline = time.monotonic() + 60
    while (kind := httpx.get(f"{server}/ready", timeout=10).json()["engines"][0]["kind"]) is None:
        assert time.monotonic() < deadline, "the server never classified its engine URL"
        time.sleep(0.05)
    return str(kind)


@pytest.fixture(scope="module")
def routed(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    urls = [engines.get(name).url for name in ENGINES]
    checkpoint = engines.checkpoint("qwen3-moe")
    logs = tmp_path_factory.mktemp("routers")
    proxies = [RecordingProxy(url, pass_disconnects=True) for url in urls]
    started: list[RunningProcess] = []
    try:
        workers = [p.url for p in proxies]
        # SGLang's /health runs a generation (a request in the engine's books): the routers probe the cheap /ready.
        probe = ("--health-check-endpoint", "/ready")
        metrics = ("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()))
        routers = {
            "sglang-router": start_router(workers, *probe, *metrics, policy="manual",
                                          log_path=logs / "sglang-router.log", startup_timeout=300),
            "smg": start_smg(workers, *probe, "--policy", "consistent_hashing", log_path=logs / "smg.log",
                             startup_timeout=300),
            "smg-rl": start_smg(workers, *probe, "--policy", "manual", "--assignment-mode", "min_load", "--enable-rl",
                                log_path=logs / "smg-rl.log", startup_timeout=300),
        }
        started += routers.values()
        servers = {}
        for name, router in routers.items():
            servers[name] = start_session_server(router.url, checkpoint, FAMILY, *SERVER_FLAGS[name],
                                                 name=f"server-{name}", log_dir=logs)
            started.append(servers[name])
        assert {name: _wait_kind(s.url) for name, s in servers.items()} == {
            "sglang-router": "sglang-router", "smg": "smg without --enable-rl", "smg-rl": "smg --enable-rl"}
        yield Routed(urls, proxies, routers, servers, checkpoint)
        for server in servers.values():
            server.close()
        for url in urls:
            assert_engine_clean(url)
    finally:
        for proc in reversed(started):
            proc.stop()
        for proxy in proxies:
            proxy.close()
        engines.stop("moe-b")  # this module's own worker: its memory back for the modules after it


@pytest.fixture
def paced_engines(routed: Routed) -> Iterator[None]:
    """Both engines paced for the test (a reply of N tokens takes N * PACE seconds at least)."""
    with contextlib.ExitStack() as stack:
        for url in routed.engines:
            stack.enter_context(paced(url, PACE))
        yield


def _whole_prompts(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls with each prompt as the engine saw it: a turn in an engine session it already used sends only its new
    tokens, which SGLang appends to what the session holds (the previous turns' prompts and outputs); the turn that
    opens one sends its whole prompt."""
    held: list[int] = []
    whole = []
    session = None
    for call in calls:
        ids = call["request"]["input_ids"]
        now = (call["request"].get("session_params") or {}).get("id")
        if now is not None and now == session:
            ids = held + ids
        session = now
        whole.append({**call, "request": {**call["request"], "input_ids": ids}})
        held = ids + call["response"]["output_ids"]
    return whole


def _chat(server: str, sid: str, messages: list[dict[str, Any]], *, stream: bool = False) -> str:
    body = {"messages": messages, **GREEDY, "stream": stream}
    r = httpx.post(chat_url(server, sid), json=body, timeout=300)
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["choices"][0]["message"]["content"])
    events = [e for e in sse_events(r.content) if e["choices"]]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


@pytest.mark.parametrize("router", ROUTERS)
def test_tito_is_exact_and_every_turn_of_a_session_reaches_one_engine(routed: Routed, router: str) -> None:
    server = routed.servers[router].url
    routed.clear()
    sessions = [new_session(server) for _ in range(4)]
    histories: dict[str, list[dict[str, Any]]] = {sid: [] for sid in sessions}
    for turn in range(3):
        for sid in sessions:
            history = histories[sid]
            history.append({"role": "user", "content": f"Question {turn} of {sid[-4:]}: why?"})
            history.append({"role": "assistant", "content": _chat(server, sid, history, stream=turn == 1)})
    for sid in sessions:
        per_engine = routed.generates(sid)
        assert sorted(len(calls) for calls in per_engine) == [0, 3], per_engine  # all three turns on one engine
        calls = next(calls for calls in per_engine if calls)
        assert [c["request"]["stream"] for c in calls] == [False, True, False]
        assert all(c["status"] == 200 for c in calls)
        sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
        spans = assert_sample_is_what_the_engine_saw(sample, _whole_prompts(calls))
        if "--engine-sessions" in SERVER_FLAGS[router]:
            # One engine session per session, opened at its second turn (the first has nothing to reuse; its KV
            # stays in the radix tree) and each later turn appended to it: the engine reuses the previous turns' KV.
            ids = [(c["request"].get("session_params") or {}).get("id") for c in calls]
            assert ids[0] is None and None not in ids[1:] and len(set(ids[1:])) == 1, ids
            cached = [c["response"]["meta_info"]["cached_tokens"] for c in calls]
            assert all(now >= start - 1 for (start, _), now in zip(spans[:-1], cached[1:], strict=True)), cached
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


def test_routed_experts_through_smg_rl(routed: Routed) -> None:
    server = routed.servers["smg-rl"].url
    routed.clear()
    sid = new_session(server)
    history: list[dict[str, Any]] = []
    for turn in range(2):
        history.append({"role": "user", "content": f"Route turn {turn}."})
        history.append({"role": "assistant", "content": _chat(server, sid, history)})
    calls = next(calls for calls in routed.generates(sid) if calls)
    assert [c["request"]["return_routed_experts"] for c in calls] == [True, True]
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
    assert sample.routed_experts is not None
    assert sample.routed_experts.shape == (len(sample.tokens), LAYERS * TOP_K)
    assert np.all(sample.routed_experts[:-1] >= 0) and np.all(sample.routed_experts[:-1] < 4)
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.usefixtures("paced_engines")
def test_an_abort_through_the_router_frees_the_engines_kv(routed: Routed, router: str, stream: bool) -> None:
    server = routed.servers[router].url
    routed.clear()
    sid = new_session(server)

    async def main() -> tuple[int, int, bytes]:
        async with httpx.AsyncClient(timeout=300) as http:
            under_way = asyncio.Event()

            async def chat() -> tuple[int, bytes]:
                async with http.stream("POST", chat_url(server, sid), json={**LONG, "stream": stream}) as reply:
                    body = b""
                    async for piece in reply.aiter_bytes():
                        body += piece
                        under_way.set()  # a streamed reply's first bytes: its status is sent
                    return reply.status_code, body

            task = asyncio.ensure_future(chat())
            async with asyncio.timeout(120):  # the request reached an engine, which runs it
                while True:
                    engine = [i for i, calls in enumerate(routed.generates(sid, settled=False)) if calls]
                    if engine:
                        break
                    await asyncio.sleep(0.05)
                await wait_loads(routed.engines[engine[0]], lambda report: report["num_running_reqs"] >= 1)
                if stream:
                    await under_way.wait()
            deleted = await http.delete(f"{server}/sessions/{sid}")
            status, body = await task
        async with asyncio.timeout(120):  # SGLang notices a plain request's caller gone within its own check (~4 s)
            for url in routed.engines:
                await wait_loads(url, lambda report: report["num_running_reqs"] == 0)
        return deleted.status_code, status, body

    deleted, status, body = asyncio.run(main())
    assert deleted == 204
    if stream:  # the stream had begun: it ends without a finish of its own
        assert status == 200
        finishes = [c.get("finish_reason") for e in sse_events(body) for c in e.get("choices") or []]
        assert not {"stop", "length"} & set(finishes), body[-500:]
    else:
        assert status == 404
    (generate,) = [c for calls in routed.generates(sid) for c in calls]
    aborts = [[c for c in p.settled(timeout=60) if c["path"] == "/abort_request"] for p in routed.proxies]
    if router == "smg-rl":  # the abort reached every engine by its rid; the one running it ended it
        assert all(calls for calls in aborts), aborts
        assert {c["request"]["rid"] for calls in aborts for c in calls} == {generate["request"]["rid"]}
        if not stream:
            assert generate["status"] == 200
            assert generate["response"]["meta_info"]["finish_reason"]["type"] == "abort"
            assert generate["response"]["meta_info"]["completion_tokens"] < LONG["max_tokens"]
    else:  # the router answered the abort 404; it dropped the engine's request when the server closed the connection
        assert aborts == [[], []]
        if stream:  # the engine's stream was cut before its end
            assert generate["response"] is None or generate["response"]["meta_info"]["finish_reason"] is None
        else:
            assert generate.get("disconnected") is True, generate
    for url in routed.engines:
        assert_engine_clean(url)


@pytest.mark.parametrize("router", ["sglang-router", "smg"])
def test_the_engine_control_paths_are_404_through_the_router(routed: Routed, router: str) -> None:
    url = routed.routers[router].url
    routed.clear()
    for path in CONTROL_PATHS:
        assert httpx.post(url + path, json={}, timeout=30).status_code == 404, path
    assert not [c for p in routed.proxies for c in p.calls if c["path"] in CONTROL_PATHS]


def test_sglang_router_drops_return_routed_experts_and_smg_keeps_it(routed: Routed) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(routed.checkpoint)("Route me.")["input_ids"]
    kept = {}
    for router in ("sglang-router", "smg"):
        routed.clear()
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_routed_experts": True, "rid": f"experts-{router}"}
        r = httpx.post(routed.routers[router].url + "/generate", json=body, headers={"X-SMG-Routing-Key": router},
                       timeout=120)
        assert r.status_code == 200, r.text
        (call,) = [c for p in routed.proxies for c in p.settled(timeout=60) if c["path"] == "/generate"]
        kept[router] = (call["request"].get("return_routed_experts"), "routed_experts" in r.json()["meta_info"])
    assert kept == {"sglang-router": (None, False), "smg": (True, True)}


@pytest.mark.usefixtures("paced_engines")
def test_pause_in_place_and_a_weight_update_through_smg_rl(routed: Routed) -> None:
    server, smg = routed.servers["smg-rl"].url, routed.routers["smg-rl"].url
    sid = new_session(server)
    routed.clear()

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as http:
            body = {**LONG, "max_tokens": 200, "stream": True}  # 40 s at PACE: the pause lands well inside it
            async with http.stream("POST", chat_url(server, sid), json=body) as reply:
                assert reply.status_code == 200
                chunks = reply.aiter_bytes()
                received = await anext(chunks)  # the reply is under way: pause now, in the middle of it
                paused = await http.post(f"{server}/admin/pause", json={"mode": "in_place"})
                try:
                    assert paused.status_code == 200, paused.text
                    # The same weights again (the engine is shared); the cache is kept, as a request still runs.
                    update = await http.post(f"{smg}/v1/rl/engine/update_weights_from_disk?selector=engine=sglang",
                                             json={"model_path": str(routed.checkpoint), "flush_cache": False})
                    assert update.status_code == 200 and update.json()["succeeded"] == 2, update.text
                finally:
                    resumed = await http.post(f"{server}/admin/continue", json={})
                assert resumed.status_code == 200, resumed.text
                async for piece in chunks:
                    received += piece
        return [e for e in sse_events(received) if e["choices"]]

    events = asyncio.run(main())
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    for proxy in routed.proxies:  # every engine paused in place, updated and resumed, in that order
        controls = [(c["path"], c.get("request")) for c in proxy.settled(timeout=60)
                    if c["path"] in ("/pause_generation", "/update_weights_from_disk", "/continue_generation")]
        assert [path for path, _ in controls] == ["/pause_generation", "/update_weights_from_disk",
                                                  "/continue_generation"]
        assert controls[0][1] == {"mode": "in_place"}
    (generate,) = [c for calls in routed.generates(sid) for c in calls]
    assert generate["status"] == 200 and generate["response"]["meta_info"]["finish_reason"]["type"] != "abort"
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


def test_pause_in_place_behind_sglang_router_is_refused_with_the_reason(routed: Routed) -> None:
    server = routed.servers["sglang-router"].url
    r = httpx.post(f"{server}/admin/pause", json={"mode": "in_place"}, timeout=30)
    assert r.status_code == 502 and "sglang-router" in r.text and "--enable-rl" in r.text, r.text
    sid = new_session(server)  # nothing was paused
    _chat(server, sid, [{"role": "user", "content": "Still serving?"}])
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=30).status_code == 204


@pytest.mark.parametrize(("router", "flag", "why"), [
    ("sglang-router", "--engine-sessions", "/open_session"),
    ("sglang-router", "--return-routed-experts", "return_routed_experts"),
    ("smg", "--engine-sessions", "--enable-rl"),
])
def test_startup_refuses_what_the_router_breaks(routed: Routed, router: str, flag: str, why: str) -> None:
    code = "import sys; from session_server.cli import main; sys.exit(main())"
    args = ["--engine-url", routed.routers[router].url, "--tokenizer", str(routed.checkpoint), "--model-family",
            FAMILY, "--port", "0", flag]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "is a router" in out.stderr and flag in out.stderr and why in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1  # one line, no traceback
