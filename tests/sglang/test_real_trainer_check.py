"""The trainer-side check (rollout.check_logprobs) on samples from the real engine: released SGLang 0.5.23 on CPU
serving the tiny fp32 checkpoints, episodes through the session server, every sampled token's logprob recomputed
with `transformers` on the same checkpoint in this venv.

The contract of docs/design.md 6: within 1e-3 in fp32 on every sampled token, whatever API drove the episode (Chat plain
and streamed, Responses, Anthropic Messages), for each segment of a compacted session and each turn cut from a merged
sample, for MoE once the recorded routed experts are replayed, and with each token scored by the weights that sampled
it when the weights change between an episode's turns. Inside one request the engine keeps the KV it computed before
an in-place update, so tokens sampled after it come from a mix of both weights: the check must say so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.logprob_check import LogprobCheckReport, check_logprobs
from support.server import chat_content, chat_url, new_session
from support.sglang_engine import Engines, Served, ServeFactory, assert_engine_clean, paced
from trajectory import Sample, samples_from_json

ATOL = 1e-3  # docs/design.md 6
GREEDY = {"temperature": 0, "max_tokens": 8}


def load(checkpoint: Path | str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense", proxied=False) as s:
        yield s


@pytest.fixture(scope="module")
def policy(served: Served) -> torch.nn.Module:
    return load(served.checkpoint)


def samples(served: Served, sid: str) -> list[Sample]:
    r = httpx.post(f"{served.server}/sessions/{sid}/samples", json={}, timeout=30)
    assert r.status_code == 200, r.text
    return samples_from_json(r.json())


def delete(served: Served, sid: str) -> None:
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=30).status_code == 204


def turns_of(merged: Sample) -> list[Sample]:
    """Each turn cut from a merged sample as build_turn_samples cuts it: its prompt and completion, mask on the
    completion, its own weight version."""
    out = []
    spans = merged.metadata["weight_version_spans"]
    for k, (start, n) in enumerate(merged.metadata["turns"]):
        mask = np.zeros(start + n, dtype=np.uint8)
        mask[start:] = 1
        out.append(Sample(
            tokens=merged.tokens[: start + n].copy(), loss_mask=mask,
            rollout_log_probs=np.where(mask == 1, merged.rollout_log_probs[: start + n], 0).astype(np.float32),
            response_length=n, status="completed",
            metadata={"turn": k, "prompt_len": start, "weight_version": spans[k][0]}))
    return out


def assert_exact(report: LogprobCheckReport, tokens: int) -> None:
    print("\n" + report.format().splitlines()[0])  # the measured figures, for `pytest -s`
    assert report.metrics["rollout_check/tokens"] == tokens, report.format()
    assert report.ok(ATOL), report.format()
    assert abs(report.metrics["rollout_corr/k3_kl"]) < 1e-6 and abs(report.metrics["rollout_corr/log_ppl_diff"]) < ATOL


def sampled(ss: list[Sample]) -> int:
    """Sampled tokens a check scores (the first position has no context, and is never sampled)."""
    return sum(int(s.loss_mask[1:].sum()) for s in ss)


# -- the three APIs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_chat_completions(served: Served, policy: torch.nn.Module, stream: bool) -> None:
    sid = new_session(served.server)
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(3):
        history.append({"role": "user", "content": f"Question {turn}: what is {turn} + {turn}?"})
        content = chat_content(served.server, sid, {"messages": history, **GREEDY, "stream": stream})
        history.append({"role": "assistant", "content": content})
    (merged,) = samples(served, sid)
    assert merged.metadata["num_turns"] == 3
    cut = turns_of(merged)
    report = check_logprobs([merged, *cut], policy, temperature=0)
    assert_exact(report, sampled([merged, *cut]))
    assert [c.num_tokens for c in report.per_sample[1:]] == [n for _, n in merged.metadata["turns"]]
    delete(served, sid)


def test_responses(served: Served, policy: torch.nn.Module) -> None:
    sid = new_session(served.server)
    url = f"{served.server}/sessions/{sid}/v1/responses"
    previous = None
    for turn in range(3):
        body: dict[str, Any] = {"model": "m", "input": f"Step {turn}: and then?", "temperature": 0,
                                "max_output_tokens": 8, "instructions": "Be brief."}
        if previous:
            body["previous_response_id"] = previous
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
    (merged,) = samples(served, sid)
    assert merged.metadata["num_turns"] == 3
    assert_exact(check_logprobs([merged], policy, temperature=0), sampled([merged]))
    delete(served, sid)


def test_anthropic_messages(served: Served, policy: torch.nn.Module) -> None:
    sid = new_session(served.server)
    url = f"{served.server}/sessions/{sid}/v1/messages"
    history: list[dict[str, Any]] = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Turn {turn}: tell me more."})
        r = httpx.post(url, json={"model": "m", "max_tokens": 8, "temperature": 0, "system": "Be brief.",
                                  "messages": history}, timeout=120)
        assert r.status_code == 200, r.text
        history.append({"role": "assistant", "content": r.json()["content"]})
    (merged,) = samples(served, sid)
    assert merged.metadata["num_turns"] == 3
    assert_exact(check_logprobs([merged], policy, temperature=0), sampled([merged]))
    delete(served, sid)


def test_a_compacted_sessions_segments(served: Served, policy: torch.nn.Module) -> None:
    """Two turns, then the agent compacts its history to a summary: the session keeps two segments, one sample
    each, and both recompute exactly."""
    sid = new_session(served.server)
    system = {"role": "system", "content": "You are terse."}
    history: list[dict[str, Any]] = [system]
    for turn in range(4):
        if turn == 2:
            history = [system, {"role": "user", "content": "Summary so far: two answers. Continue."}]
        else:
            history.append({"role": "user", "content": f"Part {turn}: go on."})
        r = httpx.post(chat_url(served.server, sid), json={"messages": history, **GREEDY}, timeout=120)
        assert r.status_code == 200, r.text
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
    got = samples(served, sid)
    assert [(s.metadata["segment"], s.metadata["num_turns"]) for s in got] == [(0, 2), (1, 2)]
    report = check_logprobs(got, policy, temperature=0)
    assert_exact(report, sampled(got))
    assert all(c.num_tokens > 0 for c in report.per_sample)
    delete(served, sid)


def test_sampled_logprobs_are_of_the_temperature_scaled_distribution(served: Served, policy: torch.nn.Module
                                                                      ) -> None:
    """What SGLang 0.5.23 returns for a sampled request is log_softmax(logits / T) (before top-p / top-k): the check
    matches it at the request's temperature and not on the raw distribution."""
    sid = new_session(served.server)
    r = httpx.post(chat_url(served.server, sid), timeout=120, json={
        "messages": [{"role": "user", "content": "Say something."}], "temperature": 0.7, "top_p": 0.9,
        "max_tokens": 24, "seed": 5})
    assert r.status_code == 200, r.text
    (merged,) = samples(served, sid)
    assert_exact(check_logprobs([merged], policy, temperature=0.7), sampled([merged]))
    assert not check_logprobs([merged], policy, temperature=1.0).ok(10 * ATOL)
    delete(served, sid)


# -- weight versions ------------------------------------------------------------------------------------------
def update_weights(engine: str, checkpoint: str, version: str, flush: bool) -> None:
    r = httpx.post(f"{engine}/update_weights_from_disk", timeout=300, json={
        "model_path": checkpoint, "weight_version": version, "flush_cache": flush})
    assert r.status_code == 200 and r.json()["success"], r.text


@pytest.fixture
def weights(served: Served, engines: Engines, policy: torch.nn.Module) -> Iterator[dict[str, torch.nn.Module]]:
    """Version -> model, the engine back on its first weights afterwards (it is shared with the tier's modules)."""
    try:
        yield {"default": policy, "step-2": load(engines.checkpoint("qwen3-dense-b"))}
    finally:
        httpx.post(f"{served.engine}/continue_generation", json={}, timeout=30)
        assert_engine_clean(served.engine)
        update_weights(served.engine, str(engines.checkpoint("qwen3-dense")), "default", True)


def test_each_turn_recomputes_with_the_weights_of_its_version(served: Served, engines: Engines,
                                                              weights: dict[str, torch.nn.Module]) -> None:
    """The trainer pushes new weights between two turns of a running episode (the server paused in place around the
    update, as the GRPO loop does): the first turn's tokens recompute with the old weights, the second's with the
    new, and scored by the old weights alone the second turn is what the check lists as worst."""
    sid = new_session(served.server)
    history: list[dict[str, Any]] = [{"role": "user", "content": "First question?"}]
    r = httpx.post(chat_url(served.server, sid), json={"messages": history, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    history += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""},
                {"role": "user", "content": "Second question?"}]
    assert httpx.post(f"{served.server}/admin/pause", json={"mode": "in_place"}, timeout=60).status_code == 200
    try:
        update_weights(served.engine, str(engines.checkpoint("qwen3-dense-b")), "step-2", True)
    finally:
        assert httpx.post(f"{served.server}/admin/continue", timeout=60).status_code == 200
    r = httpx.post(chat_url(served.server, sid), json={"messages": history, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    (merged,) = samples(served, sid)
    assert [v for v, _, _ in merged.metadata["weight_version_spans"]] == ["default", "step-2"]
    report = check_logprobs([merged, *turns_of(merged)], weights.__getitem__, temperature=0)
    assert_exact(report, sampled([merged, *turns_of(merged)]))
    assert report.per_sample[0].weight_versions == ("default", "step-2")
    stale = check_logprobs([merged], weights["default"], temperature=0, worst=5)
    assert not stale.ok(ATOL)
    assert {(w.turn, w.weight_version) for w in stale.worst} == {(1, "step-2")}
    delete(served, sid)


async def _story_with_update_inside(served: Served, sid: str, second: str, *, in_place: bool) -> None:
    """A long streamed reply; once its first tokens arrive, the engine loads `second` as version step-2: either with
    the server paused in place (generation continues in the same request), or aborting the running request with the
    radix cache flushed (the server resubmits prompt + the tokens so far, prefilled anew under step-2).

    The engine runs paced (SGLang's /slow_down, 0.05 s a step: the 400 tokens take at least 20 s on any machine), so
    the update lands in the middle of the reply, not after its end."""
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "temperature": 0, "max_tokens": 400,
            "stream": True}
    with paced(served.engine, 0.05):
        await _stream_with_update(served, sid, second, body, in_place=in_place)


async def _stream_with_update(served: Served, sid: str, second: str, body: dict[str, Any], *, in_place: bool) -> None:
    """Stream `body`, push `second` as step-2 once the first content arrives, and read the stream to its end."""
    async with httpx.AsyncClient(timeout=600) as http, http.stream("POST", chat_url(served.server, sid),
                                                                     json=body) as reply:
        assert reply.status_code == 200
        lines = reply.aiter_lines()
        async for line in lines:
            if line.startswith("data:") and '"content"' in line:
                break
        if in_place:
            paused = await http.post(f"{served.server}/admin/pause", json={"mode": "in_place"})
            assert paused.status_code == 200, paused.text
            try:
                await asyncio.to_thread(update_weights, served.engine, second, "step-2", False)
            finally:
                assert (await http.post(f"{served.server}/admin/continue")).status_code == 200
        else:
            r = await http.post(f"{served.engine}/update_weights_from_disk", timeout=300, json={
                "model_path": second, "weight_version": "step-2", "flush_cache": True, "abort_all_requests": True})
            assert r.status_code == 200 and r.json()["success"], r.text
        async for line in lines:
            assert '"error"' not in line, line


def test_an_update_inside_a_request_is_recomputed_under_the_new_weights(
        served: Served, engines: Engines, weights: dict[str, torch.nn.Module]) -> None:
    """Paused in place, SGLang keeps a running request's KV across the update, so the tokens it would sample after it
    are of neither checkpoint alone. The server's default (--straddled-replies recompute, issue 38) cuts the reply
    at the pause and continues it under the new weights' cache key once the engine continues: prompt and partial
    reply are prefilled anew, so every token recomputes exactly with the weights of its own version, those after
    the switch too. (The old in-place behaviour, `keep`: tests/sglang/test_real_weight_update.py.)"""
    sid = new_session(served.server)
    asyncio.run(_story_with_update_inside(served, sid, str(engines.checkpoint("qwen3-dense-b")), in_place=True))
    (merged,) = samples(served, sid)
    assert [v for v, _, _ in merged.metadata["weight_version_spans"]] == ["default", "step-2"]
    report = check_logprobs([merged], weights.__getitem__, temperature=0, worst=20)
    print("\n" + report.format().splitlines()[0])
    assert_exact(report, sampled([merged]))  # the switched tokens (after the update) included
    delete(served, sid)


@pytest.mark.skip(reason=(
    "racy by construction: SGLang's update_weights_from_disk aborts the reply, loads the weights, then flushes the "
    "radix cache only if the engine is idle, while the session server resubmits the continuation at once; when the "
    "resubmission wins, SGLang answers 400 'Weights were updated, but the cache was not flushed because requests "
    "are still running or queued' (seen in a fresh-clone CI run) and the continuation prefills from old-weights KV. "
    "Deterministic only once the server holds a continuation until the engine's update is done"))
def test_an_update_that_aborts_and_flushes_keeps_every_token_exact(
        served: Served, engines: Engines, weights: dict[str, torch.nn.Module]) -> None:
    """The other way to push weights under a running reply: `abort_all_requests` with `flush_cache`. The server
    resubmits prompt + the tokens sampled so far, and the engine prefills them anew under step-2 (nothing of the old
    KV survives the flush), so every token of the reply recomputes exactly with the weights of its own version."""
    sid = new_session(served.server)
    asyncio.run(_story_with_update_inside(served, sid, str(engines.checkpoint("qwen3-dense-b")), in_place=False))
    (merged,) = samples(served, sid)
    assert [v for v, _, _ in merged.metadata["weight_version_spans"]][-2:] == ["default", "step-2"]
    report = check_logprobs([merged], weights.__getitem__, temperature=0)
    assert_exact(report, sampled([merged]))
    assert report.metrics["rollout_check/switched_tokens"] > 0  # flagged, and exact all the same
    delete(served, sid)


# -- MoE --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe(serve: ServeFactory) -> Iterator[Served]:
    with serve("moe", "--return-routed-experts", proxied=False) as s:
        yield s


def test_moe_recomputes_exactly_with_routing_replay(moe: Served) -> None:
    """Each MoE layer's top-k choice replaced by the experts the engine recorded: exact. Without replay the trainer's
    own router decides, and where it picks another expert set (near-ties) tokens may move: never less mismatch."""
    model = load(moe.checkpoint)
    got: list[Sample] = []
    for episode in range(3):
        sid = new_session(moe.server)
        history: list[dict[str, Any]] = []
        for turn in range(3):
            history.append({"role": "user", "content": f"Episode {episode}, turn {turn}: and then?"})
            r = httpx.post(chat_url(moe.server, sid), json={"messages": history, "temperature": 0,
                                                            "max_tokens": 48}, timeout=300)
            assert r.status_code == 200, r.text
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
        got += samples(moe, sid)
        delete(moe, sid)
    assert all(s.routed_experts is not None for s in got)
    replayed = check_logprobs(got, model, temperature=0)
    assert_exact(replayed, sampled(got))
    assert replayed.metrics["rollout_check/replayed_samples"] == len(got)
    assert all(c.routing_rows > 0 for c in replayed.per_sample)
    own = check_logprobs(got, model, temperature=0, replay_routing=False)
    assert own.metrics["rollout_check/replayed_samples"] == 0
    assert own.max_abs_diff >= replayed.max_abs_diff - 1e-6
    assert (own.metrics["rollout_check/logprob_abs_diff_mean"]
            >= replayed.metrics["rollout_check/logprob_abs_diff_mean"] - 1e-7)
    print(f"\nMoE with replay: {replayed.format()}\nMoE without replay: {own.format()}")
