"""Engine sessions (--engine-sessions), DELETE ordering, graceful SIGTERM and the CLI contract.

The engine runs with streaming sessions enabled; a recording proxy in front of it shows which calls the session
server made and in which order (open, generate with only the new tokens, abort before close).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.launchers import RunningProcess, start_session_server
from support.server import (
    TOOLS,
    RecordingProxy,
    as_history,
    assert_engine_baseline,
    chat_url,
    engine_info,
    new_session,
    session_client,
    sse_events,
    wait_engine_idle,
    wait_running,
)
from support.sim import wait_for
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
TOKEN_MS = 5
# 100 s at the engine: cut by the DELETE long before its end, however slow the machine
LONG_CHAT = {"messages": [{"role": "user", "content": "slow [[sim: tokens 20000]]"}], "max_tokens": 20000}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--enable-streaming-session", "--token-latency-ms", str(TOKEN_MS)],
        # The order of engine calls is under test, not the control timeout: a loaded machine must not time out the
        # abort (which then is retried in the background, after the close).
        servers={"plain": [], "es": ["--engine-sessions", "--engine-control-timeout", "60"]},
        proxied={"es"},
    ) as stack:
        yield stack


async def _conversation(server: str, sid: str) -> None:
    """Four turns with a tool loop and a retried last turn (one rollback), identical on any server."""
    client = session_client(server, sid)
    messages: list[dict] = [{"role": "user", "content": 'add [[sim: tool_call name=add args={"a": 3, "b": 4}]]'}]
    r1 = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, seed=1)
    messages.append(as_history(r1.choices[0].message))
    call_id = r1.choices[0].message.tool_calls[0].id
    messages.append({"role": "tool", "tool_call_id": call_id, "content": "7"})
    r2 = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, seed=2)
    messages.append(as_history(r2.choices[0].message))
    messages.append({"role": "user", "content": "more please [[sim: tokens 9]]"})
    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, seed=3)
    # The agent retries that last turn with a different message: roll back one checkpoint.
    messages[-1] = {"role": "user", "content": "something else [[sim: tokens 6]]"}
    r3b = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, seed=3)
    messages.append(as_history(r3b.choices[0].message))
    messages.append({"role": "user", "content": "last [[sim: tokens 5]]"})
    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, seed=4)


def test_engine_sessions_give_identical_tokens(stack: dict) -> None:
    proxy: RecordingProxy = stack["proxy"]
    plain_sid, es_sid = new_session(stack["plain"]), new_session(stack["es"])
    proxy.clear()
    asyncio.run(_conversation(stack["plain"], plain_sid))
    asyncio.run(_conversation(stack["es"], es_sid))
    plain = httpx.get(f"{stack['plain']}/sessions/{plain_sid}").json()
    es = httpx.get(f"{stack['es']}/sessions/{es_sid}").json()
    assert es["token_ids"] == plain["token_ids"]
    assert [r["completion_len"] for r in es["records"]] == [r["completion_len"] for r in plain["records"]]
    for server, sid in ((stack["plain"], plain_sid), (stack["es"], es_sid)):
        raw = httpx.post(f"{server}/sessions/{sid}/samples").json()
        assert raw[0]["tokens"] == plain["token_ids"]

    # What the engine-sessions server actually sent: the first turn without an engine session (nothing to reuse),
    # the second opens one with its full prompt, then only new tokens while the session is reusable; the rollback
    # closes the engine session and opens a fresh one that gets the full prompt.
    paths = proxy.paths()
    assert paths == ["/generate", "/open_session", "/generate", "/generate", "/close_session", "/open_session",
                     "/generate", "/generate"], paths
    gens = proxy.generates()
    sids = [(g["request"].get("session_params") or {}).get("id") for g in gens]
    assert sids[0] is None and sids[1] == sids[2] != sids[3] == sids[4] and sids[1] is not None
    assert [r["engine_session"] for r in es["records"]] == ["deferred", "opened", "opened", "reused"]
    full_prompt_lens = [len(g["request"]["input_ids"]) for g in gens]
    turn_prompts = [r["prompt_len"] for r in es["records"]]
    assert full_prompt_lens[0] == plain["records"][0]["prompt_len"]
    assert full_prompt_lens[1] == turn_prompts[1]  # the engine session opened at the second turn: its full prompt
    assert full_prompt_lens[2] < turn_prompts[2]  # only the appended tokens
    assert full_prompt_lens[3] == turn_prompts[2]  # fresh engine session after the rollback: full prompt
    assert full_prompt_lens[4] == turn_prompts[3] - es["checkpoints"][2]["num_tokens"]
    assert engine_info(stack["engine"])["open_sessions"] == 1
    assert httpx.delete(f"{stack['es']}/sessions/{es_sid}").status_code == 204
    assert httpx.delete(f"{stack['plain']}/sessions/{plain_sid}").status_code == 204
    assert_engine_baseline(stack["engine"])


def test_delete_aborts_before_closing_the_engine_session(stack: dict) -> None:
    proxy: RecordingProxy = stack["proxy"]
    server, engine = stack["es"], stack["engine"]
    sid = new_session(server)
    first = {"role": "user", "content": "first [[sim: tokens 3]]"}
    reply = httpx.post(chat_url(server, sid), json={"messages": [first]}, timeout=60).json()["choices"][0]["message"]
    history = [first, {k: v for k, v in reply.items() if v is not None}]
    proxy.clear()

    async def main() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=60) as http:  # the second turn: it runs in the engine session it opens
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json={
                **LONG_CHAT, "messages": [*history, *LONG_CHAT["messages"]]}))
            await wait_running(engine)
            deleted = await http.delete(f"{server}/sessions/{sid}")
            return deleted.status_code, (await chat).status_code

    assert asyncio.run(main()) == (204, 404)
    wait_for(lambda: "/close_session" in proxy.paths(), 60)  # the close runs after the DELETE was answered
    calls = {c["path"]: c for c in proxy.settled()}
    assert proxy.paths() == ["/open_session", "/generate", "/abort_request", "/close_session"]
    assert calls["/close_session"]["started"] >= calls["/abort_request"]["finished"]
    assert calls["/close_session"]["started"] >= calls["/generate"]["finished"]  # the abort was acknowledged
    assert calls["/generate"]["response"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 404
    assert_engine_baseline(engine)


ENDLESS_CHAT = {"messages": [{"role": "user", "content": "endless [[sim: tokens 20000]]"}], "max_tokens": 20000}


async def _sigterm_during(proc: RunningProcess, url: str, engine: str, stream: bool) -> tuple[int, str, list[Any]]:
    """Send SIGTERM while a chat runs at the engine (a streamed one once its first chunk has arrived); return the
    chat's status, Retry-After header and, for a stream, its events."""
    async with httpx.AsyncClient(timeout=60) as http:
        if not stream:
            chat = asyncio.ensure_future(http.post(url, json=ENDLESS_CHAT))
            await wait_running(engine)
            proc.proc.send_signal(signal.SIGTERM)
            r = await chat
            return r.status_code, r.headers.get("retry-after", ""), []
        async with http.stream("POST", url, json={**ENDLESS_CHAT, "stream": True}) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    break  # the stream has started: its status (200) is sent
            proc.proc.send_signal(signal.SIGTERM)
            rest = "\n".join([line async for line in lines])
            return r.status_code, r.headers.get("retry-after", ""), sse_events(rest.encode())


@pytest.mark.parametrize("stream", [False, True])
def test_sigterm_answers_in_flight_chats_503_retry_after_closes_sessions_and_exits_0(stack: dict,
                                                                                    stream: bool) -> None:
    """Shutdown aborts the chats in flight and says when to come back: a plain chat gets 503 + Retry-After; a
    streamed one, whose 200 is already sent, ends with an error event carrying code 503 and retry_after. Then the
    engine sessions are closed and the process exits 0, leaving the engine at its baseline."""
    engine = stack["engine"]
    proc = start_session_server(engine, stack["tok"], FAMILY, "--engine-sessions", log_dir=stack["logs"], name="t")
    server = proc.url
    try:
        idle = new_session(server)
        history = [{"role": "user", "content": "hi [[sim: tokens 2]]"}]
        for _ in range(2):  # the second turn opens the idle session's engine session, which the shutdown closes
            r = httpx.post(chat_url(server, idle), json={"messages": history})
            assert r.status_code == 200, r.text
            history += [r.json()["choices"][0]["message"], {"role": "user", "content": "more [[sim: tokens 2]]"}]
        assert engine_info(engine)["open_sessions"] == 1
        busy = new_session(server)
        status, retry_after, events = asyncio.run(_sigterm_during(proc, chat_url(server, busy), engine, stream))
        if stream:
            assert status == 200
            error = events[-1]["error"]
            assert error["code"] == "session_paused" and error["retry_after"] >= 1, events[-1]
        else:
            assert status == 503 and int(retry_after) >= 1, (status, retry_after)
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()
    wait_engine_idle(engine)
    assert_engine_baseline(engine)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from session_server.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_cli_help_documents_every_flag() -> None:
    out = _cli("--help")
    assert out.returncode == 0
    for flag in ("--engine-url", "--tokenizer", "--model-family", "--host", "--port", "--cpu-workers",
                 "--max-rollback", "--engine-sessions", "--request-timeout", "--max-request-bytes",
                 "--message-matcher", "--admin-token", "--inline-decode", "--session-idle-timeout", "--tombstones"):
        assert flag in out.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("--tokenizer", "T", "--model-family", "qwen3"),  # missing --engine-url
        ("--engine-url", "http://x", "--tokenizer", "T", "--model-family", "qwen3", "--port", "nope"),
        ("--engine-url", "http://x", "--tokenizer", "T", "--model-family", "qwen3", "--message-matcher", "fuzzy"),
        ("--engine-url", "ftp://x", "--tokenizer", "T", "--model-family", "qwen3"),
        ("--engine-url", "http://x", "--tokenizer", "T", "--model-family", "qwen3", "--cpu-workers", "0"),
        ("--engine-url", "http://x", "--tokenizer", "T", "--model-family", "qwen3", "--session-idle-timeout", "-1"),
        ("--engine-url", "http://x", "--tokenizer", "T", "--model-family", "qwen3", "--tombstones", "-5"),
        ("--engine-url", "http://x", "--tokenizer", "/nonexistent/tokenizer", "--model-family", "qwen3"),
        ("--engine-url", "http://x", "--tokenizer", "TOK", "--model-family", "llama-nope"),
    ],
)
def test_cli_bad_invocations_exit_2_with_one_line(tokenizer_dirs: dict[str, Path], args: tuple[str, ...]) -> None:
    args = tuple(str(tokenizer_dirs[FAMILY]) if a == "TOK" else a for a in args)
    started = time.monotonic()
    out = _cli(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("session-server: error:"), out.stderr
    assert time.monotonic() - started < 60


def test_unreachable_engine_is_502_and_not_ready(stack: dict) -> None:
    from harness.launchers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with start_session_server(dead, stack["tok"], FAMILY, log_dir=stack["logs"], name="dead") as proc:
        server = proc.url
        assert httpx.get(f"{server}/health").status_code == 200  # never touches the engine
        assert httpx.get(f"{server}/ready").status_code == 503
        sid = new_session(server)
        short = {"messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):  # the slot is released after the failure
            resp = httpx.post(chat_url(server, sid), json=short)
            assert resp.status_code == 502 and resp.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{server}/sessions/{sid}").json()["records"] == []
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
