"""LoRA per session on the real engine (issue 40): released SGLang 0.5.23 on the CPU with `--enable-lora` (the test
plugin's pin-memory patch makes that start), serving the tiny `qwen3-dense` checkpoint and tiny rank-4 adapters
(scripts/build_tiny_adapters.py), a session server in front of it through a recording proxy.

What must hold: each session samples with the adapter revision it is pinned to, and each sample recomputes exactly
(within 1e-3) with the base weights plus that revision merged in (rollout/lora_merge.py); the radix cache never
serves one adapter's prefix to another or to the base model (`cached_tokens`); a revision pushed while a pinned
session runs leaves that session on its old revision while new sessions take the new one; and a revision the server
unloaded is never named in an engine request again (0.5.23 would silently load it back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.launchers import EngineProcess, start_session_server
from rollout.logprob_check import LogprobCheckReport, check_logprobs
from rollout.weight_push import WeightPusher
from support.server import RecordingProxy, chat_url, new_session
from support.sglang_engine import Engines, assert_engine_clean, paced
from trajectory import Sample, samples_from_json
from trajectory.sample_metadata import BASE_MODEL, AdapterRevision, sample_metadata

ATOL = 1e-3
GREEDY = {"temperature": 0, "max_tokens": 8}
A1, A1_NEXT, A2 = AdapterRevision("a1", "0"), AdapterRevision("a1", "1"), AdapterRevision("a2", "0")


@pytest.fixture(scope="module")
def adapter_dirs(engines: Engines) -> dict[AdapterRevision, Path]:
    out = engines.adapters()
    return {A1: out / "a1", A1_NEXT: out / "a1@1", A2: out / "a2"}


@pytest.fixture(scope="module")
def lora_engine(engines: Engines) -> Iterator[EngineProcess]:
    """The shared LoRA engine (tests/support/sglang_engine.py SPECS["lora"]), stopped at the module's end."""
    try:
        yield engines.get("lora")
    finally:
        engines.stop("lora")


class Served:
    def __init__(self, engine: str, checkpoint: Path, logs: Path) -> None:
        self.engine = engine
        self.proxy = RecordingProxy(engine)
        self.proc = start_session_server(self.proxy.url, checkpoint, "qwen3", log_dir=logs)
        self.server = self.proc.url

    def close(self) -> None:
        try:
            self.proc.close()
        finally:
            self.proxy.close()


@pytest.fixture(scope="module")
def served(lora_engine: EngineProcess, engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(lora_engine.url, engines.checkpoint("qwen3-dense"), tmp_path_factory.mktemp("served"))
    try:
        yield s
    finally:
        s.close()
    assert_engine_clean(lora_engine.url)


@pytest.fixture(scope="module")
def base_model(engines: Engines) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(engines.checkpoint("qwen3-dense"), dtype=torch.float32).eval()


def merged_sample(served: Served, sid: str) -> Sample:
    """The session's one merged sample (every session here stays on one segment)."""
    r = httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30)
    assert r.status_code == 200, r.text
    (sample,) = samples_from_json(r.json())
    return sample


def delete(served: Served, *sids: str) -> None:
    for sid in sids:
        assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204


def engine_adapters(engine: str) -> set[str]:
    data = httpx.get(f"{engine}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def check(sample: Sample, base: torch.nn.Module, dirs: dict[AdapterRevision, Path]) -> LogprobCheckReport:
    report = check_logprobs([sample], base, temperature=0, adapters=dirs)
    adapters = sorted(f"{a.name}@{a.revision}" if a.name else "base" for a in sample_metadata(sample).adapters())
    print(f"\n{'+'.join(adapters)}: {report.format().splitlines()[0]}")  # the measured figures, for `pytest -s`
    return report


async def chat(http: httpx.AsyncClient, server: str, sid: str, history: list[dict[str, Any]],
               **extra: Any) -> dict[str, Any]:
    r = await http.post(chat_url(server, sid), json={"messages": history, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return dict(r.json())


FIRST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def lora_paths(served: Served, sids: set[str]) -> dict[str, set[str | None]]:
    """Per session: every `lora_path` its engine requests named (by the engine-session-free rid routing key)."""
    out: dict[str, set[str | None]] = {}
    for call in served.proxy.calls:
        if call["path"] == "/generate" and call.get("routing_key") in sids:
            out.setdefault(call["routing_key"], set()).add(call["request"].get("lora_path"))
    return out


def test_two_adapters_and_the_base_in_concurrent_sessions(
        served: Served, base_model: torch.nn.Module, adapter_dirs: dict[AdapterRevision, Path]) -> None:
    """Three sessions (base, a1 by metadata, a2 by the model field `base:adapter`) on the same first prompt: the
    cache serves no session another one's prefix, each sample recomputes with its own adapter, and their second turns
    run concurrently."""
    assert httpx.post(f"{served.engine}/flush_cache", timeout=30).status_code == 200
    base = new_session(served.server)
    a1 = new_session(served.server, {"lora_adapter": "a1"})
    a2 = new_session(served.server)
    a1_again = new_session(served.server, {"lora_adapter": "a1"})
    models = {base: "qwen3", a1: "qwen3", a2: "qwen3:a2", a1_again: "qwen3"}

    async def run() -> dict[str, list[dict[str, Any]]]:
        histories = {sid: [dict(m) for m in FIRST] for sid in models}
        async with httpx.AsyncClient(timeout=600) as http:
            for sid in (base, a1, a2, a1_again):  # one after another: what each found cached is its own
                reply = await chat(http, served.server, sid, histories[sid], model=models[sid])
                histories[sid].append(reply["choices"][0]["message"])
                histories[sid].append({"role": "user", "content": "And three more?"})
            await asyncio.gather(*(chat(http, served.server, sid, histories[sid], model=models[sid])
                                   for sid in models))
        return histories

    asyncio.run(run())
    merged = {sid: merged_sample(served, sid) for sid in models}
    first_cached = {sid: s.metadata["cached_tokens"][0] for sid, s in merged.items()}
    prompt = merged[base].metadata["turns"][0][0]
    print(f"\nfirst turns' cached_tokens (prompt {prompt}): base {first_cached[base]}, a1 {first_cached[a1]}, "
          f"a2 {first_cached[a2]}, a1 again {first_cached[a1_again]}")
    assert first_cached[base] == first_cached[a1] == first_cached[a2] == 0  # nobody reuses another's KV
    assert first_cached[a1_again] >= prompt - 1  # the same adapter does
    assert [merged[sid].metadata["adapters"] for sid in (base, a1, a2)] == [
        [None, None], [["a1", "0"], ["a1", "0"]], [["a2", "0"], ["a2", "0"]]]
    assert lora_paths(served, set(models)) == {base: {None}, a1: {"a1"}, a2: {"a2"}, a1_again: {"a1"}}
    for sid, want in ((base, BASE_MODEL), (a1, A1), (a2, A2)):
        assert sample_metadata(merged[sid]).adapters() == {want}
        report = check(merged[sid], base_model, adapter_dirs)
        assert report.ok(ATOL), report.format()
        assert report.metrics["rollout_check/tokens"] > 0
    # Scored with the other adapter, a1's tokens are far off: the check tells adapters apart.
    wrong = check_logprobs([merged[a1]], base_model, temperature=0, adapters={A1: adapter_dirs[A2]})
    assert not wrong.ok(0.01), wrong.format()
    delete(served, *models)


def test_an_unknown_adapter_is_refused_before_any_engine_call(served: Served) -> None:
    sid = new_session(served.server, {"lora_adapter": "nope"})
    before = len(served.proxy.calls)
    r = httpx.post(chat_url(served.server, sid), json={"messages": FIRST, **GREEDY}, timeout=60)
    assert r.status_code == 404 and "nope" in r.text, r.text
    assert not [c for c in served.proxy.calls[before:] if c["path"] == "/generate"]
    delete(served, sid)


def test_a_revision_pushed_while_a_pinned_session_runs(
        served: Served, lora_engine: EngineProcess, base_model: torch.nn.Module,
        adapter_dirs: dict[AdapterRevision, Path]) -> None:
    """a1 revision 1 is pushed (pause, load as `a1@1`, continue) while a session pinned to revision 0 is mid-reply:
    that session finishes under revision 0, cut and continued, every token exact; a new session takes revision 1;
    once the old session is deleted, revision 0 is unloaded and never named again (the engine no longer lists it)."""
    old = new_session(served.server, {"lora_adapter": "a1"})
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "temperature": 0, "max_tokens": 120,
            "stream": True}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            with paced(served.engine, 0.05):
                async with http.stream("POST", chat_url(served.server, old), json=body) as reply:
                    assert reply.status_code == 200
                    lines = reply.aiter_lines()
                    async for line in lines:
                        if line.startswith("data:") and '"content"' in line:
                            break
                    async with WeightPusher(served.engine, [served.server]) as pusher:
                        pushed = await pusher.push_adapter(adapter_dirs[A1_NEXT], "a1", "1")
                    assert pushed.engine_name == "a1@1"
                    async for line in lines:
                        assert '"error"' not in line, line

    asyncio.run(run())
    new = new_session(served.server, {"lora_adapter": "a1"})
    r = httpx.post(chat_url(served.server, new), json={"messages": FIRST, **GREEDY}, timeout=300)
    assert r.status_code == 200, r.text
    old_sample, new_sample = merged_sample(served, old), merged_sample(served, new)
    assert old_sample.metadata["adapters"] == [["a1", "0"]]
    assert new_sample.metadata["adapters"] == [["a1", "1"]]
    for sample in (old_sample, new_sample):
        report = check(sample, base_model, adapter_dirs)
        assert report.ok(ATOL), report.format()
    assert engine_adapters(served.engine) >= {"a1", "a1@1", "a2"}  # the old session still holds a1
    calls = len(served.proxy.calls)
    delete(served, old)
    until(lambda: "a1" not in engine_adapters(served.engine), 60)
    # a new session and the live one go on; nothing names the unloaded revision again (0.5.23 would reload it)
    late = new_session(served.server, {"lora_adapter": "a1"})
    for sid in (late, new):
        r = httpx.post(chat_url(served.server, sid), json={"messages": FIRST, **GREEDY}, timeout=300)
        assert r.status_code == 200, r.text
    named = {c["request"].get("lora_path") for c in served.proxy.calls[calls:] if c["path"] == "/generate"}
    assert named == {"a1@1"}
    unloads = [c["request"] for c in served.proxy.calls[calls:] if c["path"] == "/unload_lora_adapter"]
    assert unloads == [{"lora_name": "a1"}]
    assert "a1" not in engine_adapters(served.engine)
    delete(served, new, late)


def until(condition: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds}s"
        time.sleep(0.2)
