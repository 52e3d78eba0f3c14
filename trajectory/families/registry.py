"""Family registry: a new family is one module plus one entry here (or a `register_family` call)."""

from __future__ import annotations

from typing import Any

from .base import ModelFamily
from .deepseek import DeepSeekFamily
from .deepseek_v4 import DeepSeekV4Family
from .gpt_oss import GptOssFamily
from .llama3 import Llama31Family
from .mistral import MistralNemoFamily
from .qwen3 import Qwen3Family
from .qwen3_vl import Qwen3VLFamily
from .qwen35 import Qwen35Family, Qwen36Family

_FAMILIES: dict[str, type[ModelFamily]] = {
    cls.name: cls for cls in (Qwen3Family, DeepSeekFamily, Qwen35Family, Qwen36Family, DeepSeekV4Family, GptOssFamily,
                                    Llama31Family, MistralNemoFamily, Qwen3VLFamily)
}


def register_family(cls: type[ModelFamily]) -> type[ModelFamily]:
    """Make `cls` available under `cls.name`; usable as a class decorator by out-of-tree families."""
    _FAMILIES[cls.name] = cls
    return cls


def family_names() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def family_class(name: str) -> type[ModelFamily]:
    """The class of family `name`: what it declares without a tokenizer (its formats, its SGLang parsers)."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(family_names())}") from None


def get_family(name: str, tokenizer: Any) -> ModelFamily:
    """Bind family `name` to an already-loaded tokenizer (loading it is the caller's I/O)."""
    return family_class(name)(tokenizer)
