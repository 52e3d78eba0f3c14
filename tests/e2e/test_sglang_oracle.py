"""Released SGLang 0.5.23 as the oracle for every engine request the server sends (issue 9 point 10).

The server talks to the sim through a recording proxy in each mode (plain, engine sessions, routed experts,
streamed chats; with tool calls, a rollback, a client disconnect that sends /abort_request, and DELETE that closes
the engine session). Every captured body is then parsed the way SGLang's HTTP server parses it -- pydantic over
SGLang's own request classes (sglang/srt/entrypoints/http_server.py: `generate_request(obj: GenerateReqInput)`,
`open_session(obj: OpenSessionReqInput)`, `close_session(obj: CloseSessionReqInput)`, `abort_request(obj: AbortReq)`)
-- and run through SGLang's own checks: `GenerateReqInput.normalize_batch_and_arguments()` (io_struct.py) and
`SamplingParams(**sampling_params)` + `.normalize(tokenizer)` + `.verify(vocab_size)` (sampling/sampling_params.py: an
unknown key is a TypeError there, which SGLang answers with 400). SGLang's package __init__ and the model stack are
not imported (tests/support/sglang_real.py fakes the few heavy modules the schema only names).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

from support.server import TOOLS, chat_url, new_session, wait_running
from support.sglang_real import import_sglang_schema
from support.sim import wait_for
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
MODES = {"plain": [], "es": ["--engine-sessions"], "routed": ["--return-routed-experts"],
         "es_routed": ["--engine-sessions", "--return-routed-experts"]}

io_struct = import_sglang_schema("sglang.srt.managers.io_struct")
sampling = import_sglang_schema("sglang.srt.sampling.sampling_params")
SCHEMAS = {
    "/generate": io_struct.GenerateReqInput,
    "/open_session": io_struct.OpenSessionReqInput,
    "/close_session": io_struct.CloseSessionReqInput,
    "/abort_request": io_struct.AbortReq,
}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--enable-streaming-session", "--token-latency-ms", "2", "--routed-experts-bytes", "4096"],
        servers=MODES, proxied=set(MODES),
    ) as stack:
        yield stack


async def _episode(server: str, engine: str) -> None:
    """Every kind of call a server makes: turns with tools and sampling fields, a streamed turn, a rollback, a
    disconnect mid-generation (abort) and DELETE (close)."""
    sid = new_session(server)
    async with httpx.AsyncClient(timeout=60) as http:
        history: list[dict[str, Any]] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": 'add [[sim: tool_call name=add args={"a": 1, "b": 2}]]'}]
        r = await http.post(chat_url(server, sid), json={
            "messages": history, "tools": TOOLS, "temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 64,
            "stop": ["\n\n\n"], "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        history += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "3"}]
        r = await http.post(chat_url(server, sid), json={"messages": history, "tools": TOOLS, "stream": True})
        assert r.status_code == 200, r.text
        history.append({"role": "user", "content": "again [[sim: tokens 5]]"})
        retry = [*history[:2], {"role": "user", "content": "retry [[sim: tokens 3]]"}]  # diverges: a rollback
        r = await http.post(chat_url(server, sid), json={"messages": retry})
        assert r.status_code in (200, 400), r.text
        long = {"messages": [{"role": "user", "content": "long [[sim: tokens 3000]]"}], "max_tokens": 4000}
        other = new_session(server)
        chat = asyncio.ensure_future(http.post(chat_url(server, other), json=long))
        await wait_running(engine)
        chat.cancel()
        with pytest.raises(asyncio.CancelledError):
            await chat
        for s in (sid, other):
            assert (await http.delete(f"{server}/sessions/{s}")).status_code == 204


def _check(path: str, body: dict[str, Any], vocab_size: int, tokenizer: Any) -> None:
    obj = TypeAdapter(SCHEMAS[path]).validate_python(body)
    if path != "/generate":
        return
    obj.normalize_batch_and_arguments()
    assert obj.is_single and obj.rid == body["rid"]
    params = sampling.SamplingParams(**(obj.sampling_params or {}))  # TypeError on a key SGLang does not know
    params.normalize(tokenizer)  # the engine's tokenizer (stop strings are encoded with it)
    params.verify(vocab_size)
    if obj.session_params:  # tokenizer_manager.py _tokenize_one_request: SessionParams(**obj.session_params)
        session = io_struct.SessionParams(**obj.session_params)
        assert session.id and not session.replace and not session.drop_previous_output and session.offset is None


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_engine_request_passes_sglangs_own_schema(stack: Stack, mode: str) -> None:
    assert stack.proxy is not None
    stack.proxy.clear()
    asyncio.run(_episode(stack[mode], stack.engine))
    expected = {"/generate", "/abort_request", *(("/open_session", "/close_session") if mode.startswith("es") else ())}
    # The disconnect's abort (and the engine session's close after it) go out in the background
    # (session_server/engine/drains.py), possibly after the episode has returned: wait for them, then check.
    proxy = stack.proxy
    wait_for(lambda: expected <= {c["path"] for c in proxy.calls}, timeout=60)
    calls = [c for c in stack.proxy.calls if c["path"] in SCHEMAS]
    seen = {c["path"] for c in calls}
    assert {"/generate", "/abort_request"} <= seen
    if mode.startswith("es"):
        assert {"/open_session", "/close_session"} <= seen
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack.tok)
    vocab = len(tokenizer)
    for call in calls:
        _check(call["path"], call.get("request") or {}, vocab, tokenizer)
    gens = [c["request"] for c in calls if c["path"] == "/generate"]
    assert any(g.get("stream") for g in gens) and any(g["sampling_params"]["max_new_tokens"] is None for g in gens)
    if "routed" in mode:
        assert all(g.get("return_routed_experts") for g in gens)


def test_the_oracle_refuses_what_sglang_refuses(tokenizer_dirs: dict[str, Path]) -> None:
    """The checks above can fail: SGLang's schema rejects what its HTTP server answers with 400. (The tokenizer
    comes by fixture: `conftest` is not a module to import from, as every test folder may have its own.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dirs[FAMILY])
    good = {"input_ids": [1, 2], "rid": "r", "sampling_params": {"max_new_tokens": None}}
    _check("/generate", good, len(tokenizer), tokenizer)
    with pytest.raises(TypeError):  # an unknown sampling key
        _check("/generate", {**good, "sampling_params": {"max_tokens": 5}}, len(tokenizer), tokenizer)
    with pytest.raises(ValueError):  # out of range
        _check("/generate", {**good, "sampling_params": {"top_p": 0.0}}, len(tokenizer), tokenizer)
    with pytest.raises(ValueError):  # pydantic: wrong type
        _check("/open_session", {"capacity_of_str_len": "many"}, 0, None)
    with pytest.raises(TypeError):  # not a SessionParams field
        _check("/generate", {**good, "session_params": {"id": "s", "bogus": 1}}, len(tokenizer), tokenizer)
