"""dedupe_prefixes (rollout/prefix_tree.py): each tree's shared prefix once in the pack, every sample's tokens
exactly `tokens[index[i]]`, the parents and positions a packed forward pass needs, and nothing shared that the
samples do not hold alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.prefix_tree import dedupe_prefixes
from support.examples import examples
from trajectory import Sample


def sample(tokens: list[int], lineage: dict[str, Any] | None = None) -> Sample:
    ids = np.asarray(tokens, np.int32)
    mask = np.zeros(len(ids), np.uint8)
    mask[-1] = 1
    s = Sample(tokens=ids, loss_mask=mask, rollout_log_probs=-0.5 * mask.astype(np.float32), response_length=1,
               status="completed", metadata={"weight_version": "default"})
    if lineage is not None:
        s.metadata["lineage"] = lineage
    return s


def lineage(parent: str, position: int, group: str, root: str, depth: int = 1) -> dict[str, Any]:
    return {"parent_session": parent, "fork_segment": 0, "fork_turns": 0, "fork_position": position,
            "group": group, "root_session": root, "depth": depth}


def check_pack(batch: Any, samples: list[Sample]) -> None:
    for i, s in enumerate(samples):
        idx = batch.index[i]
        assert batch.tokens[idx].tolist() == s.tokens.tolist()
        assert batch.positions[idx].tolist() == list(range(len(s.tokens)))
        assert batch.parents[idx[0]] == -1 and batch.parents[idx[1:]].tolist() == idx[:-1].tolist()
    held = {int(t) for idx in batch.index for t in idx}
    assert held == set(range(len(batch.tokens)))  # every packed token is someone's


def test_a_group_holds_its_prompt_once() -> None:
    prompt = list(range(100, 150))
    group = [sample([*prompt, 7, 8, k], lineage("p", 50, "g", "p")) for k in range(3)]
    other_tree = [sample([*prompt, 9], lineage("q", 50, "h", "q")), sample([*prompt, 10], lineage("q", 50, "h", "q"))]
    unforked = sample([*prompt, 11])
    samples = [*group, *other_tree, unforked]
    batch = dedupe_prefixes(samples)
    check_pack(batch, samples)
    # each tree's prompt once; the unforked sample shares nothing (even with an equal prompt)
    assert len(batch.tokens) == (50 + 3 * 3) + (50 + 2) + 51
    assert batch.shared == [0, 50, 50, 0, 50, 0]
    assert batch.sample_tokens - len(batch.tokens) == 150
    # the tree attention: a child's last token sees the prompt and its own tokens, not a sibling's
    mask = batch.attention_mask()
    last = batch.index[1][-1]
    assert set(np.flatnonzero(mask[last]).tolist()) == set(batch.index[1].tolist())
    values = np.arange(len(batch.tokens)) * 2
    assert [v.tolist() for v in batch.gather(values)] == [(batch.index[i] * 2).tolist() for i in range(6)]


def test_a_branch_in_mid_episode_points_into_its_roots_sample_and_nothing_unequal_is_shared() -> None:
    root = sample(list(range(40)))
    child = sample([*range(30), 99, 98], lineage("r", 30, "g1", "r"))
    grandchild = sample([*range(30), 99, 77], lineage("c", 31, "g2", "r", depth=2))
    liar = sample([*range(20), 5, 5, 5], lineage("r", 23, "g1", "r"))  # says 23, holds 20 alike
    samples = [grandchild, liar, child, root]
    batch = dedupe_prefixes(samples, ["gc", "l", "c", "r"])
    check_pack(batch, samples)
    assert batch.shared == [31, 20, 30, 0]
    assert len(batch.tokens) == 40 + 2 + 1 + 3
    with pytest.raises(ValueError):
        dedupe_prefixes(samples, ["r"])
    unknown = dedupe_prefixes(samples)  # the root's sample is no one's root: the child shares only with its sibling
    assert unknown.shared == [31, 0, 20, 0]
    check_pack(unknown, samples)


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_random_trees_pack_every_sample_exactly(data: st.DataObject) -> None:
    """Random trees of forks (fork positions anywhere in the parent; the root's sample in the batch or not): every
    sample is its packed tokens, a child whose parent's sample is in the batch shares at least its fork position, and
    the pack holds at least each tree's distinct prefixes (it never merges unequal ones)."""
    samples: list[Sample] = []
    ids: list[str] = []
    for tree in range(data.draw(st.integers(1, 3))):
        root_id = f"t{tree}"
        nodes = [(root_id, data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=12)), None)]
        for k in range(data.draw(st.integers(0, 6))):
            parent_id, parent_tokens, parent_lineage = nodes[data.draw(st.integers(0, len(nodes) - 1))]
            at = data.draw(st.integers(1, len(parent_tokens)))
            own = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
            depth = 1 if parent_lineage is None else parent_lineage["depth"] + 1
            lin = lineage(parent_id, at, f"{root_id}g{k}", root_id, depth)
            nodes.append((f"{root_id}c{k}", [*parent_tokens[:at], *own], lin))
        for sid, tokens, lin in nodes:
            if lin is None and not data.draw(st.booleans()):
                continue  # the root's sample may be missing from the batch
            samples.append(sample(tokens, lin))
            ids.append(sid)
    batch = dedupe_prefixes(samples, ids)
    check_pack(batch, samples)
    assert len(batch.tokens) <= batch.sample_tokens
    for i, s in enumerate(samples):
        lin = s.metadata.get("lineage")
        if lin is not None and lin["parent_session"] in ids:
            assert batch.shared[i] >= lin["fork_position"]
    trie = {(s.metadata.get("lineage", {}).get("root_session", ids[i]), tuple(s.tokens[:k + 1].tolist()))
            for i, s in enumerate(samples) for k in range(len(s.tokens))}
    assert len(batch.tokens) >= len(trie)
