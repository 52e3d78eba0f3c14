"""examples/tree_rollout: an episode that forks at its tool calls up to a budget (ARPO-style) against real processes;
its nodes' samples form the tree their lineage says, each node's return is the mean reward of the leaves below, and
the packed batch holds every shared prefix once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from examples.tree_rollout.tree import Node, SearchTask, advantages, explore
from rollout import SessionClient, dedupe_prefixes
from support.stack import Stack, StackFactory


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family="qwen3", servers={"tree": []}) as stack:
        yield stack


def grow(server: str, **kwargs: int) -> Node:
    async def main() -> Node:
        async with SessionClient(server) as client:
            return await explore(client, SearchTask("Portugal", "Porto", searches=3), **kwargs)

    return asyncio.run(main())


@pytest.mark.parametrize(("branch", "budget", "seed"), [(2, 3, 0), (3, 2, 5), (2, 0, 1)])
def test_a_tree_of_forks_at_tool_calls(stack: Stack, branch: int, budget: int, seed: int) -> None:
    server = stack["tree"]
    root = grow(server, branch=branch, budget=budget, seed=seed)
    nodes = root.walk()
    assert len(nodes) == 1 + branch * budget  # every fork of the budget was taken (3 searches leave room)
    assert httpx.get(f"{server}/admin/sessions", timeout=30).json()["sessions"] == []  # all deleted
    by_id = {n.session_id: n for n in nodes}
    for node in nodes:
        (sample,) = node.samples
        lineage = sample.metadata.get("lineage")
        if node.parent is None:
            assert lineage is None
            continue
        parent = by_id[node.parent]
        (parent_sample,) = parent.samples
        # forked at the parent's end (its tool call): the child's sample begins with the parent's whole sample
        assert lineage["parent_session"] == node.parent and lineage["root_session"] == root.session_id
        assert lineage["depth"] == node.depth and lineage["fork_position"] == len(parent_sample.tokens)
        assert sample.tokens[:len(parent_sample.tokens)].tolist() == parent_sample.tokens.tolist()
        assert len(sample.tokens) > len(parent_sample.tokens)
    for node in nodes:  # returns: a leaf's reward, an inner node's mean over the leaves below
        leaves = node.leaves
        assert node.value == pytest.approx(sum(leaf.reward or 0.0 for leaf in leaves) / len(leaves))
        if not node.children:
            assert node.reward == (1.0 if node.final_answer == "Porto" else 0.0)
    adv = advantages(root)
    assert set(adv) == {n.session_id for n in nodes if n.parent is not None}
    for node in nodes:
        if node.children:
            assert sum(adv[c.session_id] for c in node.children) == pytest.approx(0.0)
    batch = dedupe_prefixes([n.samples[0] for n in nodes], [n.session_id for n in nodes])
    saved = sum(len(by_id[n.parent].samples[0].tokens) for n in nodes if n.parent is not None)
    assert batch.sample_tokens - len(batch.tokens) == saved  # each child's prefix is its parent's, packed once
