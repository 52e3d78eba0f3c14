"""Branching in mid-episode (ARPO-style): fork the session at each tool call, up to a budget; the samples form a tree
with a return per node (examples/tree_rollout/tree.py)."""
