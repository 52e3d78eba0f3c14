"""A rollout tree: an episode that branches at its tool calls (ARPO's branching after tool calls, Tree-GRPO's tree
search), built with the session server's fork (POST /sessions/{id}/fork).

An episode runs as any tool loop does until the model calls a tool. While the tree's fork budget lasts, the node's
session is forked there into `branch` children, and the node ends: each child runs the tool itself (the environment
is stochastic, so the branches see different results) and goes on as its own episode, branching again at its next
tool call while budget remains. Every node is a session: an inner node's sample is its history up to the fork, a
leaf's is its whole episode, and each child's sample begins with its parent's tokens (its lineage says where:
`fork_position`). A leaf's reward is the task's verdict on its final answer; a node's return is the mean reward of the
leaves below it (Tree-GRPO's and TreeRL's value of a prefix), so a trainer can give each branch the advantage of its
subtree over its siblings'. `rollout.dedupe_prefixes` packs the samples with every shared prefix once.

The engine is the emulated one here (`sglang-sim` directives script the calls), but nothing in the loop knows it: the
agent only executes the calls that come back, as with a real model.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import openai

from rollout.client import SessionClient
from sglang_sim.directives import reply, tool_call
from trajectory import Sample

CITIES = ("Lyon", "Porto", "Turin", "Ghent", "Cork")


@dataclass
class SearchTask:
    """Find a country's second city with a search tool that answers right with probability `p_right`; the episode
    searches `searches` times (scripted) and answers with what its last search returned."""

    country: str
    truth: str
    searches: int = 2
    p_right: float = 0.5

    def prompt(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "You answer with one city. Search first."},
                {"role": "user", "content": f"What is the second city of {self.country}? "
                                            f"{tool_call('search', query=self.country, step=1)}"}]

    tools: ClassVar[list[dict[str, Any]]] = [{"type": "function", "function": {
        "name": "search", "description": "search the web", "parameters": {"type": "object"}}}]

    def run_tool(self, step: int, rng: random.Random) -> str:
        """The search's result, with the directive of the episode's next step (another search, or the answer)."""
        found = self.truth if rng.random() < self.p_right else rng.choice([c for c in CITIES if c != self.truth])
        after = tool_call("search", query=f"{self.country} {found}", step=step + 1) if step < self.searches \
            else reply(found)
        return f"result: {found} {after}"

    def reward(self, answer: str | None) -> float:
        return float((answer or "").strip() == self.truth)


@dataclass
class Node:
    """One session of the tree: where it came from, what it did, its sample and its return."""

    session_id: str
    parent: str | None
    depth: int
    messages: list[dict[str, Any]]
    steps: int = 0  # tool calls run by this node's line so far
    children: list[Node] = field(default_factory=list)
    final_answer: str | None = None
    reward: float | None = None  # a leaf's verdict
    value: float = 0.0  # the mean reward of the leaves below (its own for a leaf)
    samples: list[Sample] = field(default_factory=list)

    @property
    def leaves(self) -> list[Node]:
        return [self] if not self.children else [leaf for c in self.children for leaf in c.leaves]

    def walk(self) -> list[Node]:
        return [self, *(n for c in self.children for n in c.walk())]


async def explore(client: SessionClient, task: SearchTask, *, branch: int = 2, budget: int = 3, max_turns: int = 8,
                  seed: int = 0, max_tokens: int = 64) -> Node:
    """The tree of one task: forks at tool calls while `budget` forks remain (taken breadth first as calls come),
    `branch` children each. Returns the root with every node's samples, rewards and returns; deletes every session."""
    rng = random.Random(seed)
    forks_left = [budget]
    root = Node(await client.create({"task": task.country}), None, 0, task.prompt())
    made = [root.session_id]
    try:
        await _grow(client, task, root, branch, forks_left, max_turns, rng, max_tokens, made)
        nodes = root.walk()
        for node in nodes:
            node.samples = await client.collect(node.session_id)
    finally:
        for sid in made:
            await client.delete(sid)
    _returns(root)
    return root


async def _grow(client: SessionClient, task: SearchTask, node: Node, branch: int, forks_left: list[int],
                max_turns: int, rng: random.Random, max_tokens: int, made: list[str]) -> None:
    agent = openai.AsyncOpenAI(base_url=client.base_url(node.session_id), api_key="EMPTY", max_retries=0)
    try:
        pending_call: dict[str, Any] | None = None
        if node.parent is not None:  # a child starts at its parent's tool call: it runs the tool itself
            pending_call = node.messages[-1]["tool_calls"][0]
        for _ in range(max_turns):
            if pending_call is not None:
                node.steps += 1
                node.messages.append({"role": "tool", "tool_call_id": pending_call["id"],
                                      "content": task.run_tool(node.steps, rng)})
            completion = await agent.chat.completions.create(model="m", messages=node.messages,  # type: ignore[arg-type]
                                                             tools=task.tools, max_tokens=max_tokens)  # type: ignore[arg-type]
            message = completion.choices[0].message
            node.messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                node.final_answer = message.content
                node.reward = task.reward(message.content)
                return
            pending_call = node.messages[-1]["tool_calls"][0]
            if forks_left[0] > 0:  # branch here: the children run the call, this node ends at it
                forks_left[0] -= 1
                ids = await client.fork(node.session_id, branch, metadata={"step": node.steps})
                made.extend(ids)
                node.children = [Node(sid, node.session_id, node.depth + 1, json.loads(json.dumps(node.messages)),
                                      steps=node.steps) for sid in ids]
                await asyncio.gather(*(_grow(client, task, child, branch, forks_left, max_turns, rng, max_tokens,
                                             made) for child in node.children))
                return
        node.reward = 0.0  # the turn limit: no answer
    finally:
        await agent.close()


def _returns(node: Node, score: Callable[[Node], float] = lambda n: n.reward or 0.0) -> None:
    """Every node's value: the mean reward of the leaves below it."""
    for child in node.children:
        _returns(child, score)
    leaves = node.leaves
    node.value = sum(score(leaf) for leaf in leaves) / len(leaves)


def advantages(root: Node) -> dict[str, float]:
    """Each non-root node's value minus its siblings' mean (the branch's advantage at its fork, as Tree-GRPO gives
    it to the tokens the branch generated itself)."""
    out: dict[str, float] = {}
    for node in root.walk():
        if node.children:
            mean = sum(c.value for c in node.children) / len(node.children)
            out.update({c.session_id: c.value - mean for c in node.children})
    return out
