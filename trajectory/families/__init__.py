"""Model families: chat template, stop-token rules, appendable roles and completion parsers."""

from .base import ModelFamily, ParsedCompletion, ToolCall
from .deepseek import DeepSeekFamily
from .deepseek_v4 import DeepSeekV4Family
from .gpt_oss import GptOssFamily
from .llama3 import Llama31Family
from .mistral import MistralNemoFamily
from .qwen3 import Qwen3Family
from .qwen3_vl import Qwen3VLFamily
from .qwen35 import Qwen35Family, Qwen36Family
from .registry import family_class, family_names, get_family, register_family

__all__ = [
    "DeepSeekFamily",
    "DeepSeekV4Family",
    "GptOssFamily",
    "Llama31Family",
    "MistralNemoFamily",
    "ModelFamily",
    "ParsedCompletion",
    "Qwen3Family",
    "Qwen3VLFamily",
    "Qwen35Family",
    "Qwen36Family",
    "ToolCall",
    "family_class",
    "family_names",
    "get_family",
    "register_family",
]
