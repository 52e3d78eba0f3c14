"""Routed experts as released SGLang 0.5.23 returns them (issue 9 point 3).

`meta_info.routed_experts` is a base64 string of flat int32 values of shape `[rows, layers, top_k]`
(detokenizer_manager.py `_b64_encode_per_request`; state_capturer/routed_experts.py
`extract_routed_experts_from_meta_info` decodes it with `np.frombuffer(..., dtype=np.int32)`), where the rows cover
the sequence positions `[routed_experts_start_len, seqlen - 1)` with seqlen = prompt + output tokens
(batch_result_processor.py `_maybe_collect_routed_experts`): the routing of every token fed to the model, i.e. all
but the last. `layers` x `top_k` is the model's num_hidden_layers x num_experts_per_tok (the capturer's shape).

The sim's routing of a token is a fixed function of its id, layer and slot, so a re-prefilled prefix gets the same
routing as before (as a real engine's capturer keeps it for cached tokens).
"""

from __future__ import annotations

import base64

import numpy as np

N_EXPERTS = 128
DEFAULT_TOP_K = 8


def layers_for_bytes(n_bytes: int, top_k: int = DEFAULT_TOP_K, tokens: int = 1024) -> int:
    """Layers that make a `tokens`-long sequence's payload about `n_bytes` of base64 (--routed-experts-bytes)."""
    return max(1, round(n_bytes * 3 / 4 / (4 * top_k * tokens)))


def routing(tokens: np.ndarray, layers: int, top_k: int) -> np.ndarray:
    """int32 [len(tokens), layers, top_k] expert ids in [0, N_EXPERTS)."""
    t = tokens.astype(np.int64)[:, None, None]
    layer = np.arange(layers, dtype=np.int64)[None, :, None]
    slot = np.arange(top_k, dtype=np.int64)[None, None, :]
    return ((t * 2654435761 + layer * 97 + slot * 13) % N_EXPERTS).astype(np.int32)


def payload(sequence: np.ndarray, start_len: int, layers: int, top_k: int) -> str:
    """The base64 routed_experts of a finished request whose prompt + output ids are `sequence`."""
    rows = sequence[start_len : max(start_len, len(sequence) - 1)]
    return base64.b64encode(routing(rows, layers, top_k).tobytes()).decode("ascii")
