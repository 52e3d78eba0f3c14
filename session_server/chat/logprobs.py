"""`choices[0].logprobs` in OpenAI's shape, built from the very logprobs the trajectory records.

Why from the recorded arrays and not from a second engine field: the agent's view and the training sample must agree
token for token (the tests compare them). Token texts and bytes follow SGLang's `_build_token_logprobs_from_raw`:
`token` is the token decoded on its own (a display string: a lone byte of a multi-byte character shows as U+FFFD),
`bytes` are the token's true bytes, recovered through the GPT-2 byte decoder for byte-level BPE vocabularies, else the
UTF-8 of the display text. Both are cached per token id: a vocabulary is finite and replies repeat tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

_CACHE_LIMIT = 1 << 17


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in characters of byte-level BPE -> bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """token id -> (display text, bytes), for one tokenizer; thread-safe (the reply is built on the CPU pool)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = self._is_byte_level()
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._lock = threading.Lock()

    def _is_byte_level(self) -> bool:
        backend = self._backend
        if backend is None:
            return False
        decoder = getattr(backend, "decoder", None)
        return type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(ch in _BYTE_DECODER for ch in piece):
                return [_BYTE_DECODER[ch] for ch in piece]
        return list(text.encode("utf-8"))

    def lookup(self, ids: Sequence[int]) -> list[tuple[str, list[int]]]:
        missing = sorted({i for i in ids if i not in self._cache})
        if missing:
            singles = [[i] for i in missing]
            if self._backend is not None:
                texts = self._backend.decode_batch(singles, skip_special_tokens=False)
            else:
                texts = self._tokenizer.batch_decode(singles, skip_special_tokens=False)
            fresh = {i: (str(t), self._bytes(i, str(t))) for i, t in zip(missing, texts, strict=True)}
            with self._lock:
                if len(self._cache) > _CACHE_LIMIT:
                    self._cache.clear()
                self._cache.update(fresh)
            cache = {**self._cache, **fresh}
        else:
            cache = self._cache
        return [cache[i] for i in ids]


_texts_by_tokenizer: dict[int, TokenTexts] = {}
_texts_lock = threading.Lock()


def token_texts(tokenizer: Any) -> TokenTexts:
    key = id(tokenizer)
    texts = _texts_by_tokenizer.get(key)
    if texts is None:
        with _texts_lock:
            texts = _texts_by_tokenizer.setdefault(key, TokenTexts(tokenizer))
    return texts


def _as_token_ids(ids: Sequence[int]) -> list[tuple[str, list[int]]]:
    """vLLM's `return_tokens_as_token_ids`: each token named `token_id:<id>` (its bytes those of that name), so a
    client reads the ids off the logprobs even where a token's text does not round-trip."""
    return [(name, list(name.encode("ascii"))) for name in (f"token_id:{i}" for i in ids)]


def openai_logprobs(
    tokenizer: Any, output_ids: np.ndarray, logprobs: np.ndarray,
    top: list[list[tuple[float, int]]] | None, top_n: int, as_token_ids: bool = False,
) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}` for every completion token;
    `as_token_ids`: tokens named by id (`return_tokens_as_token_ids`)."""
    ids = [int(i) for i in output_ids]
    rows = top if top_n > 0 and top is not None else None
    wanted = ids + ([t for row in rows for _, t in row[:top_n]] if rows else [])
    named = _as_token_ids(wanted) if as_token_ids else token_texts(tokenizer).lookup(wanted)
    table = dict(zip(wanted, named, strict=True))
    content = []
    for i, (token_id, lp) in enumerate(zip(ids, logprobs.tolist(), strict=True)):
        text, raw = table[token_id]
        alternatives = []
        if rows is not None:
            for alt_lp, alt_id in rows[i][:top_n]:
                alt_text, alt_raw = table[alt_id]
                alternatives.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content, "refusal": None}
