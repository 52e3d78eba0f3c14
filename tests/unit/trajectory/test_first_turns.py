"""The first-turn cache (trajectory/first_turns.py): a repeated first request gets exactly the ids a fresh render
gives, for every family's real tokenizer and whatever the request; inputs that differ in any way the template could
see never share an entry; the budget, the eviction order and the clock-reading templates behave as documented."""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_server.repeated_first_turns import RepeatedFirstTurns
from support.examples import examples
from support.families import FAMILIES
from trajectory import ModelFamily
from trajectory.families.registry import get_family
from trajectory.first_turns import FirstTurnCache, NotCached, cached_only, refuse_render
from trajectory.tito import first_turn_ids

SETTINGS = settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": parameters}}


def _uncached(family: ModelFamily, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              kwargs: dict[str, Any] | None = None) -> np.ndarray:
    saved, family.first_turns = family.first_turns, FirstTurnCache(enabled=False)
    try:
        return first_turn_ids(family, messages, tools, kwargs)
    finally:
        family.first_turns = saved


@contextlib.contextmanager
def own_cache(family: ModelFamily, max_tokens: int = 1 << 20) -> Iterator[FirstTurnCache]:
    """The family with an empty cache of its own for the block (the suite shares family objects)."""
    saved, family.first_turns = family.first_turns, FirstTurnCache(max_tokens)
    try:
        yield family.first_turns
    finally:
        family.first_turns = saved


@pytest.mark.parametrize("name", FAMILIES)
@SETTINGS
@given(data=st.data())
def test_a_repeated_first_turn_has_the_ids_of_a_fresh_render(families, name, data):
    family = families[name]
    system = data.draw(st.one_of(st.none(), TEXT))
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": data.draw(TEXT) or "hi"}]
    tools = data.draw(st.one_of(st.none(), st.lists(st.builds(
        lambda n, d: _tool(f"t{n}", {"type": "object", "properties": {"q": {"type": "string", "description": d}}}),
        st.integers(0, 9), TEXT), min_size=1, max_size=3)))
    expected = _uncached(family, messages, tools)
    with own_cache(family) as cache:
        first = first_turn_ids(family, messages, tools)
        again = first_turn_ids(family, copy.deepcopy(messages), copy.deepcopy(tools))  # equal, not the same objects
        assert cache.misses == 1 and cache.hits == 1
    assert again is first and not first.flags.writeable
    np.testing.assert_array_equal(first, expected)


def test_inputs_a_template_tells_apart_never_share_an_entry(families):
    """An int from a float, a mapping's order, NaN from null, the template kwargs: each its own entry, each the
    ids of its own render (the renders differ, so a shared entry would be a wrong prompt)."""
    family = families["qwen3"]
    with own_cache(family) as cache:
        _tell_apart(family, cache)


def _tell_apart(family: ModelFamily, cache: FirstTurnCache) -> None:
    user = [{"role": "user", "content": "find it"}]
    variants: list[tuple[list[dict[str, Any]] | None, dict[str, Any] | None]] = [
        ([_tool("lookup", {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1}}})], None),
        ([_tool("lookup", {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1.0}}})], None),
        ([_tool("lookup", {"properties": {"n": {"type": "integer", "maximum": 1}}, "type": "object"})], None),
        ([_tool("lookup", {"type": "object", "properties": {"n": {"type": "number", "default": math.nan}}})], None),
        ([_tool("lookup", {"type": "object", "properties": {"n": {"type": "number", "default": None}}})], None),
        (None, None),
        (None, {"enable_thinking": False}),
    ]
    renders = []
    for tools, kwargs in variants:
        ids = first_turn_ids(family, user, tools, kwargs)
        np.testing.assert_array_equal(ids, _uncached(family, user, tools, kwargs))
        renders.append(ids.tobytes())
    assert len(set(renders)) == len(variants)  # every variant renders differently ...
    assert cache.misses == len(variants) and len(cache) == len(variants)  # ... and keyed apart
    for tools, kwargs in variants:  # each one now a hit, with its own ids
        np.testing.assert_array_equal(first_turn_ids(family, user, tools, kwargs), _uncached(family, user, tools,
                                                                                             kwargs))
    assert cache.hits == len(variants)


def _key(cache: FirstTurnCache, text: str) -> bytes:
    key = cache.key([{"role": "user", "content": text}], None, None, True)
    assert key is not None
    return key


def test_the_budget_keeps_the_most_recent_first_turns():
    cache = FirstTurnCache(max_tokens=10)
    rendered: list[int] = []

    def render(n: int) -> Callable[[], np.ndarray]:
        return lambda: rendered.append(n) or np.arange(n, dtype=np.int32)

    keys = [_key(cache, str(i)) for i in range(4)]
    for k in keys[:3]:
        cache.ids(k, render(4))
    assert cache.tokens == 8 and len(cache) == 2  # the first one went to make room for the third
    cache.ids(keys[1], render(4))  # kept: no render
    assert rendered == [4, 4, 4] and cache.hits == 1
    cache.ids(keys[3], render(4))  # keys[1] was used last: keys[2] goes
    assert cache.tokens == 8 and len(cache) == 2
    cache.ids(keys[2], render(4))  # rendered again
    assert rendered == [4, 4, 4, 4, 4] and cache.misses == 5
    big = cache.ids(_key(cache, "big"), render(11))  # larger than the whole budget: handed out, not kept
    assert len(big) == 11 and not big.flags.writeable and cache.tokens == 8 and len(cache) == 2
    cache.resize(0)
    assert cache.tokens == 0 and len(cache) == 0 and cache.key([], None, None, True) is None


def _until_waiting(cache: FirstTurnCache, key: bytes, n: int) -> None:
    """Until `n` threads wait on the render of `key` in flight (the Event's condition lists its waiters)."""
    deadline = time.monotonic() + 60  # only a hang fails: a loaded machine may start the threads late
    while len(cache._rendering[key].done._cond._waiters) < n:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the waiters never waited"
        time.sleep(0.001)


def test_a_group_arriving_together_renders_once():
    """G first turns of one prompt at once (a GRPO group launched together), on G threads as on the CPU pool: one
    renders, the others wait for its ids."""
    cache = FirstTurnCache()
    key = _key(cache, "the group's prompt")
    started, release = threading.Event(), threading.Event()
    renders: list[int] = []

    def render() -> np.ndarray:
        renders.append(1)
        started.set()
        release.wait(10)
        return np.arange(5, dtype=np.int32)

    results: list[np.ndarray] = []
    owner = threading.Thread(target=lambda: results.append(cache.ids(key, render)))
    owner.start()
    assert started.wait(10)
    waiters = [threading.Thread(target=lambda: results.append(cache.ids(key, render))) for _ in range(5)]
    for t in waiters:
        t.start()
    _until_waiting(cache, key, 5)  # all five wait on the render in flight (not a render of their own, not a hit)
    release.set()
    for t in [owner, *waiters]:
        t.join(10)
    assert len(renders) == 1 and cache.misses == 1 and cache.hits == 5
    assert len(results) == 6 and all(r is results[0] for r in results)


def test_a_failed_render_hands_nothing_on():
    """The render's error is its own request's: a waiter renders for itself, and nothing is kept."""
    cache = FirstTurnCache()
    key = _key(cache, "an unrenderable prompt")
    started, release = threading.Event(), threading.Event()

    def failing() -> np.ndarray:
        started.set()
        release.wait(10)
        raise ValueError("the template refuses it")

    errors: list[BaseException] = []

    def owner_call() -> None:
        try:
            cache.ids(key, failing)
        except ValueError as exc:
            errors.append(exc)

    owner = threading.Thread(target=owner_call)
    owner.start()
    assert started.wait(10)
    got: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: got.append(cache.ids(key, lambda: np.arange(3, dtype=np.int32))))
    waiter.start()
    _until_waiting(cache, key, 1)
    release.set()
    owner.join(10)
    waiter.join(10)
    assert len(errors) == 1 and len(got) == 1 and list(got[0]) == [0, 1, 2]
    assert cache.misses == 2 and cache.hits == 0 and len(cache) == 0  # the waiter's own render is not kept either


def test_a_template_that_reads_the_clock_keeps_no_first_turns(hf_tokenizers):
    """Real Llama 3.x templates write today's date with `strftime_now`: equal requests render differently from one
    day to the next, so such a family renders every first turn."""
    tokenizer = copy.copy(hf_tokenizers["qwen3"])
    tokenizer.chat_template = "{{ strftime_now('%d %b %Y') }}" + str(tokenizer.chat_template)
    family = get_family("qwen3", tokenizer)
    assert not family.first_turns.enabled
    family.first_turns.resize(1 << 20)  # a budget does not turn it on
    messages = [{"role": "user", "content": "what day is it"}]
    first_turn_ids(family, messages, None)
    first_turn_ids(family, messages, None)
    assert family.first_turns.hits == family.first_turns.misses == len(family.first_turns) == 0


def test_threads_sharing_the_cache_keep_its_books():
    """First turns are prepared on the CPU pool: concurrent first turns leave the token count equal to what the
    entries hold, within the budget, and every call counted once."""
    cache = FirstTurnCache(max_tokens=500)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(400):
            n = int(rng.integers(0, 60))
            cache.ids(_key(cache, str(n)), lambda n=n: np.zeros(n % 37 + 1, dtype=np.int32))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.tokens == sum(len(ids) for ids in cache._ids.values()) <= 500
    assert cache.hits + cache.misses == 6 * 400 and cache.hits > 0 and not cache._rendering


def test_cached_only_answers_from_kept_ids_or_refuses_at_once(families):
    """On the event loop (`cached_only()`) a first turn is kept ids or NotCached: never a render, never a wait for
    one, and nothing counted (the pool counts the turn when it prepares it)."""
    family = families["qwen3"]
    messages = [{"role": "user", "content": "a prompt the loop asks for"}]
    with own_cache(family) as cache:
        with cached_only(), pytest.raises(NotCached):
            first_turn_ids(family, messages, None)
        assert cache.hits == cache.misses == len(cache) == 0 and not cache._rendering
        ids = first_turn_ids(family, messages, None)
        with cached_only():
            assert first_turn_ids(family, copy.deepcopy(messages), None) is ids
        assert cache.hits == 1 and cache.misses == 1

        key = _key(cache, "still rendering")
        started, release = threading.Event(), threading.Event()
        def slow() -> np.ndarray:
            started.set()
            release.wait(10)
            return np.arange(2, dtype=np.int32)

        owner = threading.Thread(target=cache.ids, args=(key, slow))
        owner.start()
        assert started.wait(10)
        try:
            with cached_only(), pytest.raises(NotCached):  # in flight: refused at once, not waited for
                cache.ids(key, lambda: np.arange(9, dtype=np.int32))
        finally:
            release.set()
            owner.join(10)
    with own_cache(family, max_tokens=0), cached_only(), pytest.raises(NotCached):  # nothing kept: no render either
        first_turn_ids(family, messages, None)


def test_repeated_bodies_are_tried_on_the_loop():
    repeats = RepeatedFirstTurns(max_bodies=2)
    calls: list[bool] = []

    def prepare() -> str:
        calls.append(True)
        refuse_render()  # as a first turn whose ids are not kept does, inside cached_only()
        return "prepared"

    assert repeats.prepare(b"a", prepare) is None and calls == []  # first sighting: the pool's
    assert repeats.prepare(b"a", prepare) is None and calls == [True]  # a repeat, but nothing kept: the pool's
    assert repeats.prepare(b"a", lambda: "kept") == "kept" and repeats.on_loop == 1
    repeats.prepare(b"b", prepare)
    repeats.prepare(b"c", prepare)  # two remembered: "a", the oldest, is forgotten
    assert repeats.prepare(b"a", lambda: "kept") is None and repeats.on_loop == 1
    assert repeats.prepare(b"c", lambda: "kept") == "kept" and repeats.on_loop == 2
