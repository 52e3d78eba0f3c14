"""The appended text's ids from tiktoken where it is the same function as the family's Hugging Face tokenizer.

Why: tokenizing an appended turn was ~0.2 ms of a turn's CPU in `tokenizers`; tiktoken's Rust BPE gives the same ids
about 5x faster. It is used only where the two compute the same function, checked from the tokenizer's own
definition (never from a family's name); every other tokenizer keeps the Hugging Face encoder.

The same function when:
- the model is byte-level BPE (every byte a token, no dropout, byte fallback or word affixes) whose merges each make a
  vocabulary token and come in the order of those tokens' ids: a merge's priority is its token's rank, which is how
  tiktoken ranks a pair; with `ignore_merges` off, every token's own text encodes to that token (tiktoken looks a
  whole piece up first, as `ignore_merges` does). Where the merges are every split of every token into two tokens
  (tiktoken-born tokenizers: Qwen3.5/3.6, gpt-oss, Llama 3.1, Mistral Nemo) both consider exactly the same pairs at
  the same priorities (two pairs that make the same token are taken leftmost first by tiktoken, in merge order by
  Hugging Face: no test found a text where that matters). Where they are one merge per token, as BPE training leaves
  them (Qwen3: 151k merges, 294k splits), tiktoken may also consider a pair the merges lack, which these checks do not
  rule out; a hand-made vocabulary can tell the two apart, a trained one did not in any test (every token in five
  contexts, 4.3M texts over the five tiktoken-born and Qwen3; hypothesis properties over arbitrary text);
- the pre-tokenizer is one regex Split (isolated) then the byte-level mapping (no prefix space, no regex of its own):
  tiktoken's pattern, which matches every character (checked: the pattern drops no character, since tiktoken encodes
  only what it matches);
- the normalizer is none or NFC: a text that is already NFC is its own NFC (and so is every piece of it, as
  composition only looks back at what precedes a character), anything else goes to the Hugging Face encoder;
- every added token is matched on the raw text, without stripping or word rules, and is split off first as the
  Hugging Face tokenizer does (leftmost, longest: `control.trie_pattern`), the text between encoded on its own;
- no truncation or padding is set.
The checks that read every merge cost about a second, so scripts/build_tokenizers.py records their verdict in
tokenizer_config.json (`VERDICT_KEY`) with the sha256 of the definition it judged; a verdict for another definition
is ignored and the checks run at bind. Telling the two apart still costs the model's serialized state (0.3-0.9 s for a
150k-token vocabulary, paid by every process that binds the family: each test worker, for each family), so a
tokenizer loaded from a directory has its outcome remembered on disk (`VERDICTS_DIR`), keyed by the sha256 of its
tokenizer.json's bytes, of the definition's other parts and of the recorded verdict: the file holds the model, so the
same key is the same judgement, and the next bind reads it instead (~20 ms). Anything unreadable there is judged
again. tests/unit/trajectory/families/test_fast_encoder.py holds the ids to the Hugging Face encoder's.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from .control import trie_pattern

VERDICT_KEY = "tiktoken_equivalence"
CHECKS_VERSION = 1  # part of every verdict's digest: a change to the checks below makes recorded verdicts stale


def _byte_level_chars() -> dict[str, int]:
    """The byte-level pre-tokenizer's alphabet (GPT-2's `bytes_to_unicode`), character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF = _byte_level_chars()
_BYTE_TABLE = np.full(max(map(ord, _BYTE_OF)) + 2, 256, dtype=np.uint16)  # 256: not a byte-level character
for _char, _byte in _BYTE_OF.items():
    _BYTE_TABLE[ord(_char)] = _byte


@dataclass(frozen=True, slots=True)
class Definition:
    """What of a `tokenizers.Tokenizer` decides the ids of `encode(text, add_special_tokens=False)`."""

    backend: Any
    pre_tokenizer: Any
    normalizer: Any
    added: tuple[tuple[int, str, bool, bool, bool, bool], ...]  # (id, content, lstrip, rstrip, single_word, normalized)
    pipeline: tuple[Any, Any]  # truncation, padding

    @classmethod
    def of(cls, backend: Any) -> Definition:
        def state(component: Any) -> Any:
            return None if component is None else json.loads(component.__getstate__())

        added = tuple(sorted((i, t.content, t.lstrip, t.rstrip, t.single_word, t.normalized)
                             for i, t in backend.get_added_tokens_decoder().items()))
        return cls(backend, state(backend.pre_tokenizer), state(backend.normalizer), added,
                   (backend.truncation, backend.padding))

    def model(self) -> bytes:
        """The model's serialized state (vocabulary, merges, flags): ~0.1 s, so only once the cheap parts qualify."""
        return bytes(self.backend.model.__getstate__())

    def rest(self) -> bytes:
        """Everything a verdict is about but the model, and the checks' version."""
        return json.dumps([CHECKS_VERSION, self.pre_tokenizer, self.normalizer, self.added, self.pipeline],
                          sort_keys=True).encode()

    def digest(self, model: bytes) -> str:
        """sha256 of everything a verdict is about."""
        return hashlib.sha256(model + b"\x00" + self.rest()).hexdigest()


def split_pattern(definition: Definition) -> str | None:
    """The Split regex of a `Sequence[Split(Regex, isolated), ByteLevel(no prefix space, no regex)]` pre-tokenizer."""
    pre = definition.pre_tokenizer
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return None
    split, byte_level = steps
    if not (split.get("type") == "Split" and split.get("behavior") == "Isolated" and split.get("invert") is False
            and isinstance(split.get("pattern"), dict) and isinstance(split["pattern"].get("Regex"), str)):
        return None
    if not (byte_level.get("type") == "ByteLevel" and byte_level.get("add_prefix_space") is False
            and byte_level.get("use_regex") is False):
        return None
    return str(split["pattern"]["Regex"])


def structure_refusal(definition: Definition) -> str | None:
    """Why the cheap parts of the definition rule tiktoken out (None: they do not)."""
    if definition.pipeline != (None, None):
        return "truncation or padding is set"
    if definition.normalizer not in (None, {"type": "NFC"}, {"type": "Sequence", "normalizers": []}):
        return f"normalizer {definition.normalizer} is neither none nor NFC"
    if split_pattern(definition) is None:
        return "the pre-tokenizer is not one regex Split followed by the byte-level mapping"
    for _, content, lstrip, rstrip, single_word, normalized in definition.added:
        if not content or lstrip or rstrip or single_word or normalized:
            return f"added token {content!r} is empty, normalized or has strip/word rules"
    return None


def model_refusal(definition: Definition, state: bytes) -> str | None:
    """Why the model (its serialized `state`) rules tiktoken out (None: it does not); reads every merge, ~1 s."""
    model = json.loads(state)
    if model.get("type") != "BPE" or model.get("dropout") is not None or model.get("byte_fallback"):
        return "the model is not plain BPE (dropout or byte fallback)"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "the model has word affixes"
    vocab: dict[str, int] = model["vocab"]
    if any(char not in vocab for char in _BYTE_OF):
        return "not every byte is a token"
    added = {i for i, *_ in definition.added}
    last = -1
    for n, merge in enumerate(model["merges"]):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        token = vocab.get(left + right)
        if token is None:
            return f"merge {n} ({left!r}, {right!r}) makes no token"
        if token in added:  # its text is always split off before BPE: this merge never applies
            continue
        if token < last:
            return f"merge {n} ({left!r}, {right!r}) comes after a merge of a higher-ranked token"
        last = token
    if not model.get("ignore_merges"):
        for text, token in vocab.items():
            if token not in added and [t.id for t in definition.backend.model.tokenize(text)] != [token]:
                return f"token {token} ({text!r}) does not encode to itself and ignore_merges is off"
    return None


_COVERAGE: dict[str, str | None] = {}  # split pattern -> its coverage refusal, probed once per process


def coverage_refusal(core: Any, pattern: str) -> str | None:
    """tiktoken encodes only what its pattern matches: a pattern that skips a character would drop it. Once every
    byte is a token (model_refusal), whether the probe comes back whole depends on the pattern alone, so each pattern
    is probed once (0.1-0.7 s: two copies of every character encoded)."""
    if pattern not in _COVERAGE:
        codes = np.arange(0x110000, dtype=np.uint32)  # every character but surrogates and "\r\n ", in C (~20 ms)
        codes = codes[((codes < 0xD800) | (codes >= 0xE000)) & ~np.isin(codes, [ord(c) for c in "\r\n "])]
        every_char = codes.tobytes().decode("utf-32-le")
        probe = f"{every_char} \r\n{every_char}\n"
        whole = core.decode_bytes(core.encode(probe, _NONE)) == probe.encode()
        _COVERAGE[pattern] = None if whole else "the split pattern skips characters"
    return _COVERAGE[pattern]


def verdict(backend: Any) -> dict[str, Any]:
    """The record scripts/build_tokenizers.py keeps in tokenizer_config.json: the definition's digest and the refusal
    (None: tiktoken is the same function)."""
    definition = Definition.of(backend)
    state = definition.model()
    _, refusal = _judge(definition, backend.get_vocab(with_added_tokens=False), state)
    return {"sha256": definition.digest(state), "refusal": refusal}


def _judge(definition: Definition, vocab: Mapping[str, int], state: bytes | None = None,
           recorded: Any = None, source: Path | None = None) -> tuple[FastEncoder | None, str | None]:
    """(the encoder, None) where tiktoken is the same function as the definition's, else (None, why not): the cheap
    checks, then the ones that read every merge -- or, for this very definition (its digest), a `recorded` verdict.
    `state`: the model's serialized state, read here when not given (only once the cheap checks pass). `source`: the
    tokenizer.json the definition was loaded from, whose outcome is remembered on disk (`VERDICTS_DIR`)."""
    refusal = structure_refusal(definition)
    if refusal is not None:
        return None, refusal
    pattern = split_pattern(definition)
    assert pattern is not None  # structure_refusal refuses a definition without one
    try:
        core, specials = _core(definition, vocab, pattern)
    except ValueError as exc:  # the pattern does not compile in tiktoken's regex engine, the vocabulary is not bytes
        return None, str(exc)
    key = _source_key(source, definition, recorded)
    remembered = _remembered(key)
    if remembered is not None:
        refusal = remembered[0]
    else:
        state = definition.model() if state is None else state
        if isinstance(recorded, dict) and recorded.get("sha256") == definition.digest(state):
            refusal = recorded.get("refusal")
        else:
            refusal = model_refusal(definition, state) or coverage_refusal(core, pattern)
        _remember(key, None if refusal is None else str(refusal))
    if refusal is not None:
        return None, str(refusal)
    return FastEncoder(core, specials, definition.normalizer == {"type": "NFC"}), None


def _verdicts_dir() -> Path:
    """Where judged outcomes are remembered: $TRAJECTORY_CACHE_DIR, else the user's cache directory."""
    base = os.environ.get("TRAJECTORY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trajectory")
    return Path(base) / "fast-encoder-verdicts"


def _source_key(source: Path | None, definition: Definition, recorded: Any) -> str | None:
    """sha256 of the tokenizer file's bytes, the definition's other parts and the recorded verdict (None: no file)."""
    if source is None:
        return None
    try:
        data = source.read_bytes()
    except OSError:
        return None
    extra = json.dumps(recorded, sort_keys=True, default=str).encode()
    return hashlib.sha256(data + b"\x00" + definition.rest() + b"\x00" + extra).hexdigest()


def _remembered(key: str | None) -> tuple[str | None] | None:
    """(the refusal,) remembered for `key`, or None when there is none (or it cannot be read)."""
    if key is None:
        return None
    try:
        value = json.loads((_verdicts_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    refusal = value.get("refusal", 0) if isinstance(value, dict) else 0
    return (refusal,) if refusal is None or isinstance(refusal, str) else None


def _remember(key: str | None, refusal: str | None) -> None:
    """Keep the outcome for `key`, written whole (a temporary file renamed); a directory that cannot be written
    only means the next bind judges again."""
    if key is None:
        return
    folder = _verdicts_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as out:
            json.dump({"refusal": refusal}, out)
        os.replace(out.name, folder / f"{key}.json")
    except OSError:
        return


_NONE: frozenset[str] = frozenset()


class FastEncoder:
    """`encode(text)`: the Hugging Face ids of `text`, or None where this encoder does not answer (a text that is
    not NFC under an NFC normalizer, lone surrogates, a text tiktoken's regex engine gives up on)."""

    def __init__(self, core: Any, specials: Mapping[str, int], nfc: bool) -> None:
        self._core = core
        self._specials = dict(specials)
        self._split = trie_pattern(specials)
        self._nfc = nfc

    def encode(self, text: str) -> list[int] | None:
        if not text.isascii():
            if self._nfc and not unicodedata.is_normalized("NFC", text):
                return None
            try:
                text.encode()
            except UnicodeEncodeError:  # tiktoken would replace a lone surrogate; the Hugging Face encoder refuses
                return None
        ids: list[int] = []
        start = 0
        try:
            for match in self._split.finditer(text):
                if match.start() > start:
                    ids += self._ordinary(text[start:match.start()])
                ids.append(self._specials[match.group()])
                start = match.end()
            if start < len(text):
                ids += self._ordinary(text[start:])
        except ValueError:  # fancy-regex's backtracking limit (a megabyte of spaces): no answer, never a wrong one
            return None
        return ids

    def _ordinary(self, text: str) -> list[int]:
        """tiktoken's ids of text without added tokens. Through `encode`, not `encode_ordinary`: on a regex engine
        error the latter panics (an exception no `except Exception` catches), the former raises ValueError."""
        ids: list[int] = self._core.encode(text, _NONE)
        return ids


def _ranks(vocab: Mapping[str, int], added: set[int]) -> dict[bytes, int]:
    """The model's vocabulary (byte-level text -> id) as tiktoken ranks (token bytes -> id), without added tokens."""
    texts, ids = list(vocab), list(vocab.values())
    if not added.isdisjoint(ids):  # Mistral's control tokens are in the model's vocabulary too
        texts, ids = [t for t, i in zip(texts, ids, strict=True) if i not in added], [i for i in ids if i not in added]
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)
    raw = _BYTE_TABLE[np.minimum(codes, _BYTE_TABLE.size - 1)]
    if raw.size and int(raw.max()) > 255:
        raise ValueError("a token has a character outside the byte-level alphabet")
    data = raw.astype(np.uint8).tobytes()
    ends = list(accumulate(map(len, texts)))
    ranks = dict(zip([data[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)], ids, strict=True))
    if len(ranks) != len(texts):
        raise ValueError("two tokens have the same bytes")
    return ranks


def _core(definition: Definition, vocab: Mapping[str, int], pattern: str) -> tuple[Any, dict[str, int]]:
    """(tiktoken's BPE core for the vocabulary and the definition's split `pattern`, the added tokens by content). The
    Rust core that `tiktoken.Encoding` wraps: the wrapper keeps the ranks dict alive (~18 MiB for Qwen3's 151k tokens)
    only to pickle itself; the core holds its own copy."""
    from tiktoken._tiktoken import CoreBPE  # imported only where a tokenizer may qualify

    specials = {content: token for token, content, *_ in definition.added}
    ranks = _ranks(vocab, {*specials.values()})
    # The added tokens are split off before tiktoken sees the text (FastEncoder.encode); tiktoken is told them all the
    # same, since with none its own search for them matches everywhere (a third of the speed).
    return CoreBPE(ranks, specials, pattern), specials


def fast_encoder(tokenizer: Any, vocab: Mapping[str, int]) -> tuple[FastEncoder | None, str]:
    """(the tiktoken encoder, "") where it is the same function as `tokenizer`'s, else (None, why not). `vocab` is the
    model's own (`get_vocab(with_added_tokens=False)` of `tokenizer.backend_tokenizer`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None, "no Rust tokenizer"
    recorded = getattr(tokenizer, "init_kwargs", {}).get(VERDICT_KEY)
    where = getattr(tokenizer, "name_or_path", None)
    source = Path(where) / "tokenizer.json" if isinstance(where, str) and where and os.path.isdir(where) else None
    encoder, refusal = _judge(Definition.of(backend), vocab, recorded=recorded, source=source)
    return encoder, refusal or ""
