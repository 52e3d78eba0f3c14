"""Grow one rollout tree on the emulated engine and print it: python -m examples.tree_rollout [--budget 3]."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from examples.tree_rollout.tree import Node, SearchTask, advantages, explore
from harness.launchers import start_session_server, start_sim
from rollout import SessionClient, dedupe_prefixes

ROOT = Path(__file__).resolve().parents[2]


def show(node: Node, adv: dict[str, float], indent: str = "") -> None:
    tokens = len(node.samples[0].tokens) if node.samples else 0
    lineage = node.samples[0].metadata.get("lineage") if node.samples else None
    fork = f" fork@{lineage['fork_position']}" if lineage else ""
    leaf = f" answer={node.final_answer!r} reward={node.reward}" if not node.children else ""
    edge = f" adv={adv[node.session_id]:+.2f}" if node.session_id in adv else ""
    print(f"{indent}{node.session_id[:8]} tokens={tokens}{fork} value={node.value:.2f}{edge}{leaf}")
    for child in node.children:
        show(child, adv, indent + "  ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--branch", type=int, default=2)
    p.add_argument("--budget", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".cache" / "tokenizers" / "qwen3")
    args = p.parse_args()
    sim = start_sim(str(args.tokenizer), "qwen3")
    server = start_session_server(sim.url, str(args.tokenizer), "qwen3")

    async def run() -> Node:
        async with SessionClient(server.url) as client:
            return await explore(client, SearchTask("Portugal", "Porto"), branch=args.branch, budget=args.budget,
                                 seed=args.seed)

    try:
        root = asyncio.run(run())
    finally:
        server.stop()
        sim.stop()
    show(root, advantages(root))
    nodes = root.walk()
    batch = dedupe_prefixes([n.samples[0] for n in nodes], [n.session_id for n in nodes])
    print(f"{len(nodes)} nodes, {len(root.leaves)} leaves; {batch.sample_tokens} sample tokens packed into "
          f"{len(batch.tokens)} (each shared prefix once)")


if __name__ == "__main__":
    main()
