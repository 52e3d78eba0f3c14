"""A structured routed-experts payload of a requested size, serialized once.

Why: with `return_routed_experts`, a real MoE engine returns per-token expert routing that dominates the response
size (about 1.5 MiB in our benchmarks). The session server must carry such payloads without parsing them, so the sim
produces a realistic nested numeric structure ([token][layer][top-k] expert ids) of roughly the requested size.
Building and serializing it per response would make the sim itself the bottleneck, so it is built once per size.
"""

from __future__ import annotations

from functools import lru_cache

import msgspec
import numpy as np

LAYERS = 8
TOP_K = 8
N_EXPERTS = 128


@lru_cache(maxsize=8)
def payload(n_bytes: int, seed: int = 0) -> bytes:
    """JSON bytes of about n_bytes: a list of per-token rows, each [layer][top_k] expert ids."""
    rng = np.random.default_rng(seed)
    row = rng.integers(0, N_EXPERTS, size=(LAYERS, TOP_K)).tolist()
    row_bytes = len(msgspec.json.encode(row)) + 1
    n_rows = max(1, round(n_bytes / row_bytes))
    rows = rng.integers(0, N_EXPERTS, size=(n_rows, LAYERS, TOP_K)).tolist()
    return msgspec.json.encode(rows)
