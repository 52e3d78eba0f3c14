"""The trainer's side end to end: real `sglang-sim` and `session-server` processes, the official openai client.

One engine and two session servers in front of it for the whole module (starting processes is the slow part).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from harness.scripted_tasks import reply_directive, shopping_tasks
from rollout.client import SessionClient
from rollout.episodes import AgentConfig, EpisodeResult, Task, iter_episodes, run_episode, run_episodes
from rollout.errors import SessionNotFoundError, SessionServerError, UnknownSessionError
from rollout.prefix_tree import dedupe_prefixes
from rollout.tools import default_toolbox
from rollout.torch_batch import to_torch_batch
from support.server import metric, wait_engine_idle, wait_running
from support.stack import Stack, StackFactory
from trajectory import Sample

FAMILY = "qwen3"
# A reply long enough to still be generating when the test cancels it, however slow the machine: 60 s at 5 ms a token
# (every such episode is cancelled, so it costs nothing; three of them fit the sim's KV at once).
SLOW_REPLY = "[[sim: tokens 12000]]"
TOKEN_LATENCY_MS = "5"
SLOW = AgentConfig(max_tokens=12000)
CUT_WITHIN = 20.0  # seconds for a cancelled episode's engine request to be gone: a third of its reply


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY, sim_args=["--token-latency-ms", TOKEN_LATENCY_MS], servers={"a": [], "b": []}
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizers: dict[str, object]):
    return hf_tokenizers[FAMILY]


def session_status(server: str, session_id: str) -> int:
    return httpx.get(f"{server}/sessions/{session_id}").status_code


async def asession_status(server: str, session_id: str) -> int:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{server}/sessions/{session_id}")).status_code


def assert_aligned(sample: Sample) -> None:
    """Mask 1 exactly on sampled tokens, whose logprobs are finite and <= 0; everything else has logprob 0."""
    n = len(sample.tokens)
    assert sample.tokens.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert sample.rollout_log_probs.dtype == np.float32
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == n
    assert set(np.unique(sample.loss_mask).tolist()) <= {0, 1}
    sampled = sample.loss_mask == 1
    assert sampled.any()
    assert np.all(sample.rollout_log_probs[~sampled] == 0.0)
    assert np.all(np.isfinite(sample.rollout_log_probs)) and np.all(sample.rollout_log_probs[sampled] <= 0.0)
    assert not sampled[: n - sample.response_length].any(), "the first prompt is never sampled"


def sampled_segments(sample: Sample) -> list[np.ndarray]:
    """The token runs with mask 1, in order: one per generated turn."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask.astype(np.int8), [0]])))
    return [sample.tokens[start:end] for start, end in zip(edges[::2], edges[1::2], strict=True)]


# -- episodes -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sixteen(stack: dict) -> tuple[list[EpisodeResult], list[str]]:
    pairs = shopping_tasks(16, seed=5)

    async def main() -> list[EpisodeResult]:
        async with SessionClient(stack["a"]) as client:
            return await run_episodes(client, [t for t, _ in pairs], concurrency=8)

    return asyncio.run(main()), [answer for _, answer in pairs]


def test_sixteen_tool_episodes_complete(sixteen: tuple[list[EpisodeResult], list[str]], stack: dict) -> None:
    results, expected = sixteen
    assert [r.index for r in results] == list(range(16))
    for r, answer in zip(results, expected, strict=True):
        assert r.ok, r.error
        assert r.stop_reason == "final_answer"
        assert r.final_answer == answer  # the scripted reply, reached through lookups and the calculator
        assert r.turns >= 4 and r.tool_calls >= r.turns - 1
        tool_results = [m["content"] for m in r.messages if m["role"] == "tool"]
        assert "error:" not in " ".join(tool_results)
        assert len(r.samples) == 1
        assert session_status(stack["a"], r.session_id) == 404  # deleted after collection
    assert {r.server for r in results} == {stack["a"]}
    assert metric(stack["a"], "session_server_sessions") == 0


def test_merged_samples_are_aligned_with_the_turns(sixteen: tuple[list[EpisodeResult], list[str]], tokenizer) -> None:
    results, _ = sixteen
    for r in results:
        (sample,) = r.samples
        assert_aligned(sample)
        assert sample.status == "completed"
        segments = sampled_segments(sample)
        assistant = [m for m in r.messages if m["role"] == "assistant"]
        assert len(segments) == len(assistant) == r.turns
        for tokens, message in zip(segments, assistant, strict=True):
            text = tokenizer.decode(tokens.tolist())
            for call in message.get("tool_calls", []):
                assert call["function"]["name"] in text and call["function"]["arguments"] in text
            if message.get("content"):
                assert message["content"] in text
        # what the policy saw: the whole episode, including the tool results that are not sampled
        full = tokenizer.decode(sample.tokens.tolist())
        for m in r.messages:
            if m["role"] in ("user", "tool"):
                assert m["content"] in full


def test_torch_batch_matches_the_samples(sixteen: tuple[list[EpisodeResult], list[str]]) -> None:
    samples = [s for r in sixteen[0] for s in r.samples]
    batch = to_torch_batch(samples, pad_id=0)
    width = max(len(s.tokens) for s in samples)
    assert batch["input_ids"].shape == (16, width)
    assert batch["response_lengths"].tolist() == [s.response_length for s in samples]
    assert batch["loss_mask"].sum().item() == sum(int(s.loss_mask.sum()) for s in samples)
    for row, s in enumerate(samples):
        n = len(s.tokens)
        assert batch["attention_mask"][row].sum().item() == n
        assert np.array_equal(batch["input_ids"][row, :n].numpy(), s.tokens.astype(np.int64))
        assert np.array_equal(batch["loss_mask"][row, :n].numpy(), s.loss_mask.astype(np.float32))
        assert np.array_equal(batch["rollout_log_probs"][row, :n].numpy(), s.rollout_log_probs)


def test_failures_are_reported_per_episode(stack: dict) -> None:
    """A task the server refuses (400) fails alone; its session is still deleted, the others complete."""
    good = [t for t, _ in shopping_tasks(2, seed=9)]
    bad = Task(messages=[{"role": "wizard", "content": "hi"}], toolbox=default_toolbox())

    async def main() -> list[EpisodeResult]:
        async with SessionClient(stack["a"]) as client:
            results = await run_episodes(client, [good[0], bad, good[1]], concurrency=3)
            assert client.open_sessions() == {stack["a"]: 0}
            return results

    results = asyncio.run(main())
    assert [r.ok for r in results] == [True, False, True]
    failed = results[1]
    assert failed.stop_reason == "error" and "400" in failed.error and failed.samples == []
    assert isinstance(failed.exception, openai.BadRequestError)
    assert session_status(stack["a"], failed.session_id) == 404


def test_turn_limit_stops_the_loop(stack: dict) -> None:
    task, _ = shopping_tasks(1, seed=3, max_turns=2)[0]

    async def main() -> EpisodeResult:
        async with SessionClient(stack["a"]) as client:
            return await run_episode(client, task)

    result = asyncio.run(main())
    assert result.ok and result.stop_reason == "turn_limit" and result.turns == 2
    assert result.final_answer is None and len(result.samples) == 1


# -- cancellation -------------------------------------------------------------------------------------------------


class RecordingClient(SessionClient):
    """Remembers every session it created, so the test can ask the server about them afterwards."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.created: list[str] = []

    async def create(self, metadata=None) -> str:
        session_id = await super().create(metadata)
        self.created.append(session_id)
        return session_id


def slow_task() -> Task:
    messages = [{"role": "user", "content": f"Tell me a long story. {SLOW_REPLY}"}]
    return Task(messages=messages, toolbox=default_toolbox())


@pytest.mark.parametrize("cancels", [1, 5], ids=["cancel-once", "cancel-repeatedly"])
def test_cancelled_episode_leaves_no_session(stack: dict, cancels: int) -> None:
    """Cancelled mid-chat, the episode deletes its session before the cancellation reaches the caller, even when
    the caller keeps cancelling during the cleanup (the DELETE is shielded)."""

    async def main() -> list[str]:
        async with RecordingClient(stack["a"]) as client:
            episode = asyncio.create_task(run_episode(client, slow_task(), config=SLOW))
            await wait_running(stack["engine"])
            for _ in range(cancels):
                episode.cancel()
                for _ in range(3):
                    await asyncio.sleep(0)  # let the cleanup start, then cancel it again
            with pytest.raises(asyncio.CancelledError):
                await episode
            assert client.open_sessions() == {stack["a"]: 0}  # the DELETE completed before the cancel surfaced
            await asyncio.to_thread(wait_engine_idle, stack["engine"], CUT_WITHIN)
            return client.created

    (session_id,) = asyncio.run(main())
    assert session_status(stack["a"], session_id) == 404
    assert metric(stack["a"], "session_server_sessions") == 0
    assert metric(stack["a"], "session_server_in_flight") == 0


def test_cancelling_a_batch_of_episodes_deletes_every_session(stack: dict) -> None:
    async def main() -> tuple[list[str], list[EpisodeResult]]:
        finished: list[EpisodeResult] = []
        async with RecordingClient(stack["a"]) as client:
            tasks = [slow_task() for _ in range(6)]

            async def consume() -> None:
                async for result in iter_episodes(client, tasks, concurrency=3, config=SLOW):
                    finished.append(result)

            batch = asyncio.ensure_future(consume())
            await wait_running(stack["engine"], 3)  # cancelled with three chats at the engine, whatever the speed
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
            assert client.open_sessions() == {stack["a"]: 0}
            return client.created, finished

    created, finished = asyncio.run(main())
    assert len(created) == 3 and finished == []  # three in flight, none finished, none started after the cancel
    assert all(session_status(stack["a"], sid) == 404 for sid in created)
    assert metric(stack["a"], "session_server_sessions") == 0


# -- several servers ----------------------------------------------------------------------------------------------


def test_two_servers_share_the_load(stack: dict) -> None:
    servers = [stack["a"], stack["b"]]
    chats_before = {url: metric(url, 'session_server_stage_seconds_count{stage="commit"}') for url in servers}
    pairs = shopping_tasks(8, seed=11)

    async def main() -> list[EpisodeResult]:
        async with SessionClient(servers) as client:
            return await run_episodes(client, [t for t, _ in pairs], concurrency=4)

    results = asyncio.run(main())
    assert all(r.ok for r in results), [r.error for r in results]
    per_server = {url: [r for r in results if r.server == url] for url in servers}
    assert all(len(rs) >= 2 for rs in per_server.values()), {u: len(rs) for u, rs in per_server.items()}
    for url, rs in per_server.items():  # each server really served the turns of its own sessions
        chats = metric(url, 'session_server_stage_seconds_count{stage="commit"}') - chats_before[url]
        assert chats == sum(r.turns for r in rs)


def test_least_loaded_placement_and_pinning(stack: dict) -> None:
    a, b = stack["a"], stack["b"]

    async def main() -> None:
        async with SessionClient([a, b]) as client:
            first = [await client.create() for _ in range(4)]
            assert client.open_sessions() == {a: 2, b: 2}
            on_a = [sid for sid in first if client.server_of(sid) == a]
            for sid in on_a:
                assert client.base_url(sid) == f"{a}/sessions/{sid}/v1"
                assert await asession_status(b, sid) == 404  # pinned to its server
                assert await asession_status(a, sid) == 200
                assert await client.delete(sid) is True
            more = [await client.create() for _ in range(2)]
            assert {client.server_of(sid) for sid in more} == {a}  # the emptier server gets the new ones
            for sid in [*first, *more]:
                if sid not in on_a:
                    await client.delete(sid)
            assert client.open_sessions() == {a: 0, b: 0}

    asyncio.run(main())


# -- the client API ------------------------------------------------------------------------------------------------


def test_session_client_api(stack: dict) -> None:
    server = stack["a"]

    async def main() -> None:
        async with SessionClient(server) as client:
            health = await client.health()
            assert health[server]["status"] == "ok"
            async with client.session(metadata={"purpose": "api-test"}) as sid:
                agent = openai.AsyncOpenAI(base_url=client.base_url(sid), api_key="EMPTY", max_retries=0)
                messages = [{"role": "user", "content": f"Say hi. {reply_directive('Hello there.')}"}]
                reply = await agent.chat.completions.create(model="default", messages=messages)
                assert reply.choices[0].message.content == "Hello there."
                await agent.close()
                info = await client.info(sid)
                binary = await client.collect(sid)
                as_json = await client.collect(sid, format="json")
                (cut,) = await client.collect(sid, max_seq_len=len(binary[0].tokens) - 2)
            assert info["metadata"] == {"purpose": "api-test"}
            assert len(binary) == len(as_json) == 1
            for name in ("tokens", "loss_mask", "rollout_log_probs"):
                assert np.array_equal(getattr(binary[0], name), getattr(as_json[0], name))
            assert binary[0].tokens.tolist() == info["token_ids"]
            assert cut.status == "truncated" and len(cut.tokens) == len(binary[0].tokens) - 2
            # gone on the server, forgotten by the client
            assert await asession_status(server, sid) == 404
            with pytest.raises(UnknownSessionError):
                client.base_url(sid)
            with pytest.raises(ValueError):
                await client.collect(sid, format="xml")

    asyncio.run(main())


def test_session_context_deletes_on_error_and_404s_are_typed(stack: dict) -> None:
    server = stack["a"]

    async def main() -> str:
        async with SessionClient(server) as client:
            with pytest.raises(RuntimeError, match="agent crashed"):
                async with client.session() as sid:
                    raise RuntimeError("agent crashed")
            assert client.open_sessions() == {server: 0}
            # a session deleted behind the client's back: delete reports it gone, other calls raise 404
            other = await client.create()
            async with httpx.AsyncClient() as http:
                assert (await http.delete(f"{server}/sessions/{other}")).status_code == 204
            with pytest.raises(SessionNotFoundError) as excinfo:
                await client.collect(other)
            assert excinfo.value.status == 404 and isinstance(excinfo.value, SessionServerError)
            assert await client.delete(other) is False
            return sid

    assert session_status(server, asyncio.run(main())) == 404


def test_busy_turn_is_retried_after_retry_after(stack: dict) -> None:
    """A paused server answers 503 + Retry-After; the episode waits, retries the same turn, and completes."""
    server = stack["b"]
    task, answer = shopping_tasks(1, seed=2)[0]

    refused = 'session_server_responses_total{method="POST",route="/sessions/{session_id}/v1/chat/completions",' \
        'status="503"}'

    async def main() -> EpisodeResult:
        async with SessionClient(server) as client, httpx.AsyncClient() as admin:
            assert (await admin.post(f"{server}/admin/pause", json={"mode": "drain"})).status_code == 200
            before = await asyncio.to_thread(metric, server, refused, 0.0)
            episode = asyncio.create_task(
                run_episode(client, task, config=AgentConfig(max_retry_after=0.2, busy_retries=50))
            )
            async with asyncio.timeout(60):  # two refusals seen, however slow the machine
                while True:
                    if await asyncio.to_thread(metric, server, refused, 0.0) >= before + 2:
                        break
                    await asyncio.sleep(0.05)
            assert not episode.done()
            assert (await admin.post(f"{server}/admin/continue")).status_code == 200
            return await episode

    result = asyncio.run(main())
    assert result.ok, result.error
    assert result.final_answer == answer and result.busy_retries >= 2


def test_groups_run_as_forks_of_one_primed_session(stack: dict) -> None:
    """run_episodes(fork_groups=G): each G tasks of one prompt start as one primed session forked into G; the episodes
    end as unforked ones do, their samples name the group (one per prompt) and the prompt's length as the fork
    position, and no session is left behind (the primed parent is deleted after the fork)."""
    pairs = shopping_tasks(2, seed=11)
    # a group's three tasks: one prompt, each with its own scripted toolbox (it counts the episode's turns)
    tasks = [shopping_tasks(index + 1, seed=11)[index][0] for index in (0, 0, 0, 1, 1, 1)]

    async def main() -> list[EpisodeResult]:
        async with SessionClient(stack["a"]) as client:
            return await run_episodes(client, tasks, concurrency=6, fork_groups=3)

    results = asyncio.run(main())
    assert [r.index for r in results] == list(range(6))
    groups = []
    for r in results:
        assert r.ok, r.error
        assert r.final_answer == pairs[r.index // 3][1]
        (sample,) = r.samples
        lineage = sample.metadata["lineage"]
        assert lineage["depth"] == 1 and lineage["fork_turns"] == 0
        assert 0 < lineage["fork_position"] < len(sample.tokens)
        assert not sample.loss_mask[:lineage["fork_position"]].any()  # the shared prefix is the prompt
        groups.append(lineage["group"])
    assert groups[0] == groups[1] == groups[2] != groups[3] == groups[4] == groups[5]
    # the batch helper holds each group's prompt once: the second and third episodes point into the first's
    batch = dedupe_prefixes([r.samples[0] for r in results])
    prompts = [r.samples[0].metadata["lineage"]["fork_position"] for r in results]
    assert batch.shared == [0, prompts[1], prompts[2], 0, prompts[4], prompts[5]]
    assert batch.sample_tokens - len(batch.tokens) == 2 * prompts[0] + 2 * prompts[3]
    assert httpx.get(f"{stack['a']}/admin/sessions").json()["sessions"] == []
    with pytest.raises(ValueError, match="share their prompt"):
        asyncio.run(run_episodes(SessionClient(stack["a"]), [pairs[0][0], pairs[1][0]], fork_groups=2))


def test_demo_rl_rollouts_run_their_groups_as_forks(stack: dict, tokenizer) -> None:
    """examples/demo_rl with --fork-groups: its rollouts launch each group as forks of one primed session."""
    import random

    from examples.demo_rl.game import THINKING_OFF, WeatherGame
    from examples.demo_rl.rollouts import Rollouts

    async def main() -> list:
        async with SessionClient(stack["a"]) as client:
            rollouts = Rollouts(client, WeatherGame(tokenizer), AgentConfig(max_tokens=8, extra_body=THINKING_OFF),
                                group_size=3, ahead_groups=2, rng=random.Random(0), fork_groups=True)
            rollouts.start()
            try:
                return await rollouts.take(2)
            finally:
                await rollouts.stop()

    groups = asyncio.run(main())
    seen = set()
    for group in groups:
        assert len(group.results) == 3 and all(r.ok for r in group.results), [r.error for r in group.results]
        lineages = [r.samples[0].metadata["lineage"] for r in group.results]
        assert len({lineage["group"] for lineage in lineages}) == 1 and lineages[0]["fork_turns"] == 0
        seen.add(lineages[0]["group"])
    assert len(seen) == 2
