"""engine/adapters.py: a session pinned to one adapter revision, refused before any engine call when the engines do
not hold it, revisions learned after a load, and a superseded revision unloaded once no session holds it (and never
named again), with in-process fake workers that answer `/v1/models` as SGLang 0.5.23 does."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import pytest

from session_server.engine.adapters import (
    AdapterBook,
    AdapterRef,
    AdapterUnavailableError,
    adapter_cache_key,
    listed_adapters,
    model_adapter,
)
from session_server.engine.client import EngineReply
from session_server.engine.placement import EnginePlacement
from session_server.engine.versions import cache_key
from session_server.errors import EngineUnavailableError
from trajectory.errors import RequestValidationError


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """An async test run on its own event loop."""
    @functools.wraps(test)
    def sync() -> None:
        asyncio.run(test())
    return sync


class FakeLoraEngine:
    """An engine's adapter list and its unload calls."""

    def __init__(self, url: str, adapters: list[str]) -> None:
        self.base_url = url
        self.adapters = list(adapters)
        self.unloads: list[str] = []
        self.model_calls = 0

    async def models(self) -> EngineReply:
        self.model_calls += 1
        data = [{"id": "base", "parent": None}, *({"id": a, "parent": "base"} for a in self.adapters)]
        return EngineReply(200, msgspec.json.encode({"object": "list", "data": data}), "application/json")

    async def generation_control(self, path: str, body: dict[str, Any], deadline: float | None = None) -> None:
        assert path == "/unload_lora_adapter"
        self.unloads.append(body["lora_name"])
        self.adapters.remove(body["lora_name"])

    async def aclose(self) -> None:
        pass


def _book(*workers: list[str], **kw: Any) -> tuple[AdapterBook, list[FakeLoraEngine]]:
    engines = [FakeLoraEngine(f"http://w{i}", adapters) for i, adapters in enumerate(workers)]
    return AdapterBook(EnginePlacement(engines, health_interval=0), **kw), engines  # type: ignore[arg-type]


def test_names_and_keys() -> None:
    assert AdapterRef.parse("a1") == AdapterRef("a1", "0")
    assert AdapterRef.parse("a1@3") == AdapterRef("a1", "3")
    assert AdapterRef("a1", "3").engine_name == "a1@3" and AdapterRef("a1", "0").engine_name == "a1"
    assert model_adapter("qwen3:a1") == "a1" and model_adapter("qwen3") is None and model_adapter(None) is None
    assert adapter_cache_key(cache_key("default"), None) == "weights:default"
    assert adapter_cache_key(cache_key("2"), AdapterRef("a1", "3")) == "weights:2|lora:a1@3"
    assert adapter_cache_key(cache_key("2", 1), AdapterRef("a1", "3")) == "weights:2#1|lora:a1@3"
    assert listed_adapters(b'{"data": [{"id": "m", "parent": null}, {"id": "a1", "parent": "m"}]}') == {"a1"}
    assert listed_adapters(b"nope") is None


@run
async def test_a_session_is_pinned_and_checked_before_any_engine_call() -> None:
    book, (engine,) = _book(["a1", "a2"])
    ref = await book.for_turn("s1", {"lora_adapter": "a1"}, None)
    assert ref == AdapterRef("a1", "0")
    assert await book.for_turn("s2", {}, "qwen3:a2") == AdapterRef("a2", "0")  # the OpenAI model field
    assert await book.for_turn("s3", {}, "qwen3") is None  # no adapter named: the base model
    assert await book.for_turn("s4", {"lora_adapter": ""}, "qwen3:a1") is None  # metadata "" pins the base model
    with pytest.raises(RequestValidationError, match="pinned to 'a1'"):
        await book.for_turn("s1", {"lora_adapter": "a1"}, "qwen3:a2")
    with pytest.raises(RequestValidationError, match="pinned to the base model"):
        await book.for_turn("s3", {}, "qwen3:a1")
    with pytest.raises(AdapterUnavailableError, match="no LoRA adapter 'nope'"):
        await book.for_turn("s5", {"lora_adapter": "nope"}, None)
    assert "s5" not in book.pins
    calls = engine.model_calls
    assert await book.for_turn("s1", {"lora_adapter": "a1"}, None) == ref  # known held: no list asked again
    assert engine.model_calls == calls


@run
async def test_default_adapter_and_startup_check() -> None:
    book, _ = _book(["a1"], default="a1")
    await book.startup()
    assert await book.for_turn("s1", {}, None) == AdapterRef("a1", "0")
    missing, _ = _book(["a2"], default="a1")
    with pytest.raises(RuntimeError, match="--lora-adapter 'a1'"):
        await missing.startup()


@run
async def test_an_adapter_held_by_one_worker_only_is_not_held() -> None:
    book, _ = _book(["a1", "a2"], ["a1"])
    assert await book.refresh() == {"a1"}
    with pytest.raises(AdapterUnavailableError):
        await book.for_turn("s1", {"lora_adapter": "a2"}, None)


@run
async def test_revisions_pinned_sessions_finish_under_theirs_and_the_old_one_is_unloaded_when_unheld() -> None:
    book, (engine,) = _book(["a1"])
    old = await book.for_turn("old", {"lora_adapter": "a1"}, None)
    engine.adapters.append("a1@1")  # the trainer loaded revision 1
    assert await book.learn("a1", "1") == AdapterRef("a1", "1")
    assert engine.unloads == []  # "old" still holds a1
    assert await book.for_turn("old", {"lora_adapter": "a1"}, None) == old  # pinned: finishes under revision 0
    assert await book.for_turn("new", {"lora_adapter": "a1"}, None) == AdapterRef("a1", "1")
    book.release("old")
    await book.aclose()
    assert engine.unloads == ["a1"] and "a1" in book.unloaded
    # 0.5.23 would load it again if a request named it: the book never does
    with pytest.raises(AdapterUnavailableError, match="was unloaded"):
        await book.check(old)
    engine.adapters.append("a1")  # even if an engine lists it again
    with pytest.raises(AdapterUnavailableError, match="was unloaded"):
        await book.check(old)


@run
async def test_latest_moves_each_next_turn_and_unloads_behind_it() -> None:
    book, (engine,) = _book(["a1"], follow="latest")
    assert await book.for_turn("s", {"lora_adapter": "a1"}, None) == AdapterRef("a1", "0")
    engine.adapters.append("a1@1")
    await book.learn("a1", "1")
    assert await book.for_turn("s", {"lora_adapter": "a1"}, None) == AdapterRef("a1", "1")
    await book.aclose()
    assert engine.unloads == ["a1"]


@run
async def test_a_revision_the_engines_do_not_list_is_refused_at_learn() -> None:
    book, _ = _book(["a1"])
    with pytest.raises(EngineUnavailableError, match="do not list 'a1@2'"):
        await book.learn("a1", "2")
    assert book.current == {"a1": "0"}


@run
async def test_a_restored_session_keeps_its_recorded_revision() -> None:
    book, _ = _book(["a1", "a1@1"])
    await book.refresh()
    assert book.current["a1"] == "1"  # the newest listed
    assert await book.for_turn("s", {}, None, recorded=AdapterRef("a1", "0")) == AdapterRef("a1", "0")


@run
async def test_keep_adapter_revisions_unloads_nothing() -> None:
    book, (engine,) = _book(["a1"], unload=False)
    await book.for_turn("s", {"lora_adapter": "a1"}, None)
    engine.adapters.append("a1@1")
    await book.learn("a1", "1")
    book.release("s")
    assert await book.unload_unheld() == [] and engine.unloads == []


@run
async def test_a_colon_in_the_model_name_of_an_engine_without_adapters_is_not_an_adapter() -> None:
    book, (engine,) = _book([])
    assert await book.for_turn("s", {}, "qwen3:8b") is None
    assert await book.for_turn("t", {}, "qwen3:8b") is None
    assert engine.model_calls == 1  # asked once
    with_lora, _ = _book(["a1"])
    with pytest.raises(AdapterUnavailableError, match="'8b'"):
        await with_lora.for_turn("s", {}, "qwen3:8b")
