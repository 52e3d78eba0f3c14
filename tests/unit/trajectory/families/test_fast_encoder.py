"""The tiktoken encoder (trajectory/families/fast_encoder.py) gives the Hugging Face tokenizer's ids exactly, and only
tokenizers that are provably the same function get one; the rest keep the Hugging Face encoder."""

from __future__ import annotations

import functools
import json
import unicodedata
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import FAMILIES
from support.tito import appended_turns
from trajectory import ModelFamily, get_family
from trajectory.families import fast_encoder as fe

# The tiktoken-born tokenizers (their merges are every split of every token, in rank order) and Qwen3 (one merge per
# token, in rank order, ignore_merges off: every token's text encodes to itself). DeepSeek's pre-tokenizer is three
# regex Splits in a row, which one tiktoken pattern does not express.
QUALIFYING = ("qwen3", "qwen3.5", "qwen3.6", "gpt-oss", "llama-3.1", "mistral-nemo")
SETTINGS = settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hf_ids(family: ModelFamily, text: str) -> list[int]:
    return list(family.tokenizer.backend_tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_which_families_get_the_fast_encoder(families, name):
    family = families[name]
    assert (family.fast_encoder is not None) == (name in QUALIFYING), family.fast_encoder_refusal
    if name in ("deepseek", "deepseek-v4"):
        assert "pre-tokenizer" in family.fast_encoder_refusal


@pytest.mark.parametrize("name", FAMILIES)
def test_the_built_directories_carry_their_verdict(hf_tokenizers, name):
    """scripts/build_tokenizers.py records the verdict for exactly the definition a family binds to, so binding reads
    it instead of judging every merge again."""
    tokenizer: Any = hf_tokenizers[name]
    definition = fe.Definition.of(tokenizer.backend_tokenizer)
    recorded = tokenizer.init_kwargs[fe.VERDICT_KEY]
    assert recorded["sha256"] == definition.digest(definition.model())
    assert (recorded["refusal"] is None) == (name in QUALIFYING)


_WHITESPACE = st.text(st.sampled_from(" \t\n\r\x0b\x0c\x85\xa0\u1680\u2000\u2028\u2029\u202f\u3000"), min_size=1,
                      max_size=6)
_DIGITS = st.text(st.sampled_from("0123456789٣৪๕"), min_size=1, max_size=8)
_NON_NFC = st.sampled_from(["e\u0301", "A\u030a", "\u1100\u1161", "\u0338", "Å", "ﬁ", "\u0301"])
_CONTRACTIONS = st.sampled_from(["'s", "'S", "'ll", "'LL", "'ſ", "'re", "'ve", "'m", "'d", "'t", "'"])
_ANY = st.text(st.characters(codec="utf-8"), max_size=16)
_LATIN = st.text(st.characters(max_codepoint=0x24F), max_size=16)


@functools.cache
def texts(family: ModelFamily) -> st.SearchStrategy[str]:
    """Text as any mix of what splits differently: letters in any script, marks, digits, whitespace runs,
    contractions, non-NFC sequences, and every added token's spelling (the family's own markup and the rest). Built
    once per family, not per example (each read of the added tokens copies them out of the Rust tokenizer)."""
    specials = sorted(t.content for t in family.tokenizer.added_tokens_decoder.values())
    piece = (_ANY | _LATIN | _WHITESPACE | _DIGITS | _CONTRACTIONS | _NON_NFC | st.sampled_from(specials))
    return st.lists(piece, max_size=8).map("".join)


@functools.cache
def normalizes_to_nfc(family: ModelFamily) -> bool:
    """Whether the family's tokenizer normalizes to NFC (its definition serializes the tokenizer's parts: once)."""
    return bool(fe.Definition.of(family.tokenizer.backend_tokenizer).normalizer == {"type": "NFC"})


@pytest.mark.parametrize("name", QUALIFYING)
@SETTINGS
@given(data=st.data())
def test_the_fast_encoder_gives_the_hugging_face_ids(families, name, data):
    family = families[name]
    text = data.draw(texts(family), "text")
    ids = family.fast_encoder.encode(text)
    if normalizes_to_nfc(family) and not unicodedata.is_normalized("NFC", text):
        assert ids is None  # not NFC: the Hugging Face encoder answers
    else:
        assert ids == hf_ids(family, text)
    assert family.encode(text) == hf_ids(family, text)


@pytest.mark.parametrize("name", QUALIFYING)
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_appended_turns_encode_to_the_hugging_face_ids(families, name, data):
    """The texts TITO encodes on every turn: the fidelity tests' appended turns as the family renders them."""
    from trajectory.errors import SessionError

    family = families[name]
    try:
        text = family.appended_text(data.draw(appended_turns(family), "appended"), None,
                                    closed=data.draw(st.booleans(), "closed"))
    except SessionError:
        return
    assert family.fast_encoder.encode(text) in (None, hf_ids(family, text))
    assert family.encode(text) == hf_ids(family, text)


@pytest.mark.parametrize("name", QUALIFYING)
def test_vocabulary_tokens_in_context_encode_to_the_hugging_face_ids(families, name):
    """Where tiktoken's BPE and the merges could part: a token's text glued to itself, cut by a byte at either end,
    or inside a word, where other merges compete for its bytes (every 97th token here; all of them, 4.3M texts, when
    the encoder was written)."""
    family = families[name]
    tokenizer: Any = family.tokenizer
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    words = [w for w in (tokenizer.decode([i]) for i in sorted(vocab.values())[::97]) if "\ufffd" not in w]
    texts = [t for w in words for t in (w + w, "e" + w + "s", w[:-1] + w, w + w[1:], w[1:] + w[:-1])]
    expected = [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    got = [family.fast_encoder.encode(t) for t in texts]
    assert [(t, g) for t, g, e in zip(texts, got, expected, strict=True) if g not in (None, e)] == []


@pytest.mark.parametrize("name", QUALIFYING)
@pytest.mark.parametrize("text", [
    "", "x", "e\u0301 <|im_start|>\u0338 'ſ 12345 \r\n\n  x",
    "<|im_start|>user\n" + "word " * 3000 + "<|im_end|>", "\n\n\n   \n\t \r\n", "東京123abc 𝔘𝔫𝔦", "don'T I'LL we'ſ",
])
def test_pinned_texts(families, text, name):
    family = families[name]
    ids = family.fast_encoder.encode(text)
    assert ids is None or ids == hf_ids(family, text)
    assert family.encode(text) == hf_ids(family, text)


def test_a_text_tiktoken_gives_up_on_is_left_to_the_hugging_face_encoder(families):
    """fancy-regex's backtracking limit (a megabyte of spaces), where the Hugging Face encoder's Oniguruma answers:
    no answer, never a wrong one."""
    family = families["qwen3"]
    text = " " * 1_000_000
    assert family.fast_encoder.encode(text) is None
    assert family.encode(text) == hf_ids(family, text)


def test_a_lone_surrogate_is_left_to_the_hugging_face_encoder(families):
    """tiktoken would replace it with U+FFFD; the Hugging Face encoder refuses it, and so the family still does."""
    family = families["qwen3"]
    assert family.fast_encoder.encode("a\ud800b") is None
    with pytest.raises(TypeError):
        family.encode("a\ud800b")


# -- tokenizers that do not qualify ------------------------------------------------------------------------------


_PATTERN = r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+"


def _tiny(tokens: tuple[str, ...] = ("ab", "abc", "cab"), merges: list[tuple[str, str]] | None = None,
          ignore_merges: bool = True, **options: Any) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast`: the 256 bytes, then `tokens` in id order, made by `merges`
    (default: every split of every token in the order of their ids, as a tiktoken-born tokenizer has them), and one
    added token."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(fe._BYTE_OF, key=fe._BYTE_OF.__getitem__))}
    vocab.update({token: 256 + i for i, token in enumerate(tokens)})
    if merges is None:
        merges = [(t[:k], t[k:]) for t in tokens for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(options.get("pattern", _PATTERN)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=options.get("prefix_space", False), use_regex=False),
    ])
    if options.get("lowercase"):
        tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.add_tokens([AddedToken("<end>", normalized=False, special=True, lstrip=options.get("lstrip", False))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _bind(tokenizer: Any) -> tuple[fe.FastEncoder | None, str]:
    return fe.fast_encoder(tokenizer, tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False))


def test_a_tiktoken_born_tiny_tokenizer_qualifies():
    tokenizer = _tiny()
    encoder, refusal = _bind(tokenizer)
    assert encoder is not None and refusal == ""
    for text in ("abcab cab<end>abab", "cabc<end><end> 12", "ab\n\n c"):
        assert encoder.encode(text) == tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize(("tokenizer", "reason"), [
    (lambda: _tiny(("ab", "bc"), [("b", "c"), ("a", "b")]), "comes after a merge of a higher-ranked token"),
    (lambda: _tiny(lowercase=True), "normalizer"),
    (lambda: _tiny(prefix_space=True), "pre-tokenizer"),
    (lambda: _tiny(lstrip=True), "strip/word rules"),
    (lambda: _tiny(pattern=r"\p{L}+|\s+"), "the split pattern skips characters"),  # digits, punctuation: dropped
    # ignore_merges off: BPE of "abc" stops at "ab" + "c" (no such merge), where tiktoken looks the whole piece up
    (lambda: _tiny(("ab", "bc", "abc"), [("a", "b"), ("b", "c"), ("a", "bc")], ignore_merges=False),
     "does not encode to itself"),
])
def test_tokenizers_that_are_not_the_same_function_are_refused(tokenizer, reason):
    encoder, refusal = _bind(tokenizer())
    assert encoder is None and reason in refusal


def test_a_split_pattern_is_probed_for_coverage_once(monkeypatch):
    """Whether the probe of every character comes back whole is the pattern's alone (every byte is a token by then):
    a second tokenizer with the same pattern is not probed again, one with another pattern is."""
    monkeypatch.setattr(fe, "_COVERAGE", {})
    probes: list[int] = []
    encode = fe.coverage_refusal

    def counted(core: Any, pattern: str) -> str | None:
        probes.append(len(fe._COVERAGE))
        return encode(core, pattern)

    monkeypatch.setattr(fe, "coverage_refusal", counted)
    assert _bind(_tiny(("ab", "bc")))[0] is not None
    assert _bind(_tiny(("ab", "abc", "cab")))[0] is not None
    assert _bind(_tiny(pattern=r"\p{L}+|\s+")) == (None, "the split pattern skips characters")
    assert probes == [0, 1, 1] and len(fe._COVERAGE) == 2


def test_a_recorded_verdict_counts_only_for_the_definition_it_judged():
    good, bad = _tiny(("ab", "bc")), _tiny(("ab", "bc"), [("b", "c"), ("a", "b")])
    verdict = fe.verdict(good.backend_tokenizer)
    assert verdict["refusal"] is None
    bad.init_kwargs[fe.VERDICT_KEY] = verdict  # a stale or foreign verdict: ignored, the merges are judged again
    assert _bind(bad)[0] is None
    good.init_kwargs[fe.VERDICT_KEY] = {**verdict, "refusal": "recorded"}  # its own: trusted, the merges not read
    assert _bind(good) == (None, "recorded")


def test_a_real_tokenizer_with_two_merges_swapped_falls_back(hf_tokenizers, tmp_path):
    """Qwen3 with its merges 10 and 11 swapped: not the same function as tiktoken over the same ranks, so the family
    keeps the Hugging Face encoder, and its ids are that tokenizer's own. (Loaded from the edited file: a tokenizer
    object passed in is deep-copied by transformers, which parses the whole definition a second time.)"""
    from transformers import PreTrainedTokenizerFast

    qwen3: Any = hf_tokenizers["qwen3"]
    definition = json.loads(qwen3.backend_tokenizer.to_str())
    merges = definition["model"]["merges"]
    merges[10], merges[11] = merges[11], merges[10]
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                        chat_template=qwen3.chat_template, eos_token="<|im_end|>")
    tokenizer.init_kwargs[fe.VERDICT_KEY] = qwen3.init_kwargs[fe.VERDICT_KEY]  # the unswapped tokenizer's verdict
    family = get_family("qwen3", tokenizer)
    assert family.fast_encoder is None and "comes after a merge of a higher-ranked token" in family.fast_encoder_refusal
    text = "<|im_start|>user\nthe merges decide these ids<|im_end|>\n"
    assert family.encode(text) == tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_a_judged_outcome_is_remembered_by_the_tokenizer_files_bytes(tmp_path, monkeypatch):
    """A tokenizer loaded from a directory is judged once: the next bind reads the outcome kept for its file's bytes
    (no model state serialized); other bytes, another recorded verdict or an unreadable cache are judged afresh."""
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("TRAJECTORY_CACHE_DIR", str(tmp_path / "cache"))
    serialized: list[int] = []
    model = fe.Definition.model
    monkeypatch.setattr(fe.Definition, "model", lambda self: serialized.append(1) or model(self))

    def saved(tokenizer: Any, name: str) -> Any:
        tokenizer.save_pretrained(tmp_path / name)
        return PreTrainedTokenizerFast.from_pretrained(tmp_path / name)

    first = _bind(saved(_tiny(("ab", "bc")), "good"))  # the one full judgement here (every character encoded)
    assert first[0] is not None and first[1] == "" and len(serialized) == 1
    again = _bind(saved(_tiny(("ab", "bc")), "good-copy"))  # the same bytes elsewhere: the same outcome, remembered
    assert again[0] is not None and again[1] == "" and len(serialized) == 1
    assert again[0].encode("abc bcab") == first[0].encode("abc bcab")
    swapped = _tiny(("ab", "bc"), [("b", "c"), ("a", "b")])  # refused at its merges: judged cheaply
    refused = _bind(saved(swapped, "swapped"))  # other bytes: judged
    assert refused[0] is None and "comes after a merge" in refused[1] and len(serialized) == 2
    assert _bind(saved(swapped, "swapped-copy")) == refused and len(serialized) == 2
    recorded = saved(swapped, "swapped-recorded")
    recorded.init_kwargs[fe.VERDICT_KEY] = {**fe.verdict(recorded.backend_tokenizer), "refusal": "recorded"}
    assert _bind(recorded) == (None, "recorded")  # a recorded verdict is part of the key: its own is trusted
    for kept in (tmp_path / "cache").rglob("*.json"):
        kept.write_text("{not json")
    count = len(serialized)
    assert _bind(saved(swapped, "swapped-3")) == refused and len(serialized) == count + 1  # unreadable: judged again
