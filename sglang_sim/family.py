"""The model family as the engine sees it: stop tokens, vocabulary and the exact text format of a reply.

Why an adapter: the sim must emit what the real model emits (Qwen's `<tool_call>` JSON, DeepSeek's tool-call
tokens) so the session server's parsers run for real. `trajectory.get_family` is the single source of that format;
this module only adds what an engine needs on top (message boundaries for reading directives, BOS trimming,
per-token texts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from trajectory import get_family
from trajectory.image_grid import QWEN3_VL, ImageGeometry, VisionTokens

_SEGMENT_CACHE = 16384


class FamilyLike(Protocol):
    """The subset of `trajectory.ModelFamily` the engine relies on."""

    name: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    eos_token_id: int
    inline_message_starts: tuple[str, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Any) -> str: ...

    def format_completion(self, content: str, reasoning_content: str | None,
                          tool_calls: list[tuple[str, str]]) -> str: ...

    def opened_reply(self, prompt_ids: Any) -> str: ...

    def stop_token_after(self, text: str) -> int: ...


@dataclass
class EngineFamily:
    """A family plus the tokenizer facts the engine needs, computed once at start-up."""

    family: FamilyLike
    tokenizer: Any
    boundary_ids: np.ndarray  # added-token ids: they separate chat messages in a rendered prompt
    bos_token_id: int | None
    backend: Any = None  # the Rust tokenizer, used directly when it decodes exactly like the HF wrapper
    vision: VisionTokens | None = None  # the vocabulary's image markers (None: images are refused)
    geometry: ImageGeometry = QWEN3_VL  # the image processor's resize (the checkpoint's preprocessor_config.json)
    _encoded: dict[str, list[int]] = field(default_factory=dict)
    _segments: dict[bytes, str] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, tokenizer: Any, geometry: ImageGeometry = QWEN3_VL,
               family: FamilyLike | None = None) -> EngineFamily:
        """`family`: `tokenizer` already bound to family `name` (binding one again costs up to seconds; tests share
        theirs), else bound here."""
        family = family if family is not None else get_family(name, tokenizer)
        boundary = np.array(sorted(int(i) for i in tokenizer.added_tokens_decoder), dtype=np.int32)
        bos = tokenizer.bos_token_id
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            backend = None  # the wrapper post-processes decoded text; keep its exact behaviour
        try:
            vision: VisionTokens | None = VisionTokens.from_tokenizer(tokenizer)
        except ValueError:
            vision = None
        return cls(family=family, tokenizer=tokenizer, boundary_ids=boundary,
                   bos_token_id=int(bos) if bos is not None else None, backend=backend, vision=vision,
                   geometry=geometry)

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def vocab_size(self) -> int:
        return int(self.family.vocab_size)

    def encode(self, text: str) -> list[int]:
        return list(self.family.encode(text))

    def encode_cached(self, text: str) -> list[int]:
        """Encode a short, often repeated text (reply words) once."""
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = self.encode(text)
        return ids

    def decode_text(self, ids: np.ndarray | list[int], skip_special_tokens: bool) -> str:
        as_list = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        if self.backend is not None:
            return str(self.backend.decode(as_list, skip_special_tokens=skip_special_tokens))
        return str(self.tokenizer.decode(as_list, skip_special_tokens=skip_special_tokens))

    def segment_text(self, ids: np.ndarray) -> str:
        """Decoded text of one message segment; cached because conversations resend the same messages every turn."""
        key = ids.tobytes()
        text = self._segments.get(key)
        if text is None:
            if len(self._segments) >= _SEGMENT_CACHE:
                self._segments.clear()
            text = self._segments[key] = self.decode_text(ids, skip_special_tokens=False)
        return text

    def token_texts(self, ids: np.ndarray | list[int]) -> list[str]:
        """Per-token texts as SGLang reports them in logprobs (each id decoded alone)."""
        singles = [[int(i)] for i in ids]
        if self.backend is not None:
            return [str(t) for t in self.backend.decode_batch(singles, skip_special_tokens=False)]
        return [str(t) for t in self.tokenizer.batch_decode(singles)]

    def message_segments(self, ids: np.ndarray) -> list[np.ndarray]:
        """Split a rendered prompt at added tokens: every chat template delimits messages with them."""
        if len(ids) == 0:
            return []
        cuts = np.flatnonzero(np.isin(ids, self.boundary_ids))
        return [seg for seg in np.split(ids, cuts) if len(seg)]
