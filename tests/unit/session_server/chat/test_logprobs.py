"""OpenAI logprob entries from recorded token ids: texts as the token decodes alone, true bytes of byte-level pieces."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from session_server.chat.logprobs import openai_logprobs
from support.families import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_rebuild_the_text_even_across_split_characters(family: str, hf_tokenizers: dict[str, Any]) -> None:
    tok = hf_tokenizers[family]
    text = "naïve 𠮷 café → ok"
    ids = tok.encode(text, add_special_tokens=False)
    lps = np.linspace(-0.1, -2.0, len(ids)).astype(np.float32)
    out = openai_logprobs(tok, np.asarray(ids), lps, None, 0)
    entries = out["content"]
    assert out["refusal"] is None and len(entries) == len(ids)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8") == text
    assert [e["logprob"] for e in entries] == lps.tolist()
    assert all(e["token"] == tok.decode([i]) and e["top_logprobs"] == [] for e, i in zip(entries, ids, strict=True))


def test_top_logprobs_are_cut_to_the_requested_count(hf_tokenizers: dict[str, Any]) -> None:
    tok = hf_tokenizers["qwen3"]
    ids = np.asarray(tok.encode("hello world", add_special_tokens=False))
    alt = tok.encode(" river", add_special_tokens=False)[0]
    top = [[(-0.1, int(i)), (-1.5, alt), (-2.5, 200)] for i in ids]
    out = openai_logprobs(tok, ids, np.full(len(ids), -0.1, dtype=np.float32), top, 2)
    for entry, i in zip(out["content"], ids, strict=True):
        assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, -1.5]
        assert entry["top_logprobs"][0]["token"] == tok.decode([int(i)])
        assert entry["top_logprobs"][1]["token"] == " river" and entry["top_logprobs"][1]["bytes"] == list(b" river")
