"""The CLI and ServerConfig agree by construction: a flag's default is its config field's default, and every flag
named like a config field reaches the config (nothing is parsed and then dropped)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from session_server.cli import _default, build_parser, config_from_args
from session_server.config import ServerConfig
from support.families import FAMILIES

REQUIRED = ["--engine-url", "http://127.0.0.1:1", "--tokenizer", "T", "--model-family", "qwen3"]


def test_flag_defaults_are_the_config_defaults() -> None:
    args = vars(build_parser().parse_args(REQUIRED))
    shared = [f.name for f in dataclasses.fields(ServerConfig) if f.name in args]
    assert len(shared) >= 10
    for name in shared:
        if name in ("engine_url", "engine_urls", "tokenizer", "model_family"):
            continue
        assert args[name] == _default(name), name


def test_every_flag_named_like_a_field_reaches_the_config() -> None:
    args = build_parser().parse_args([*REQUIRED, "--max-rollback", "3", "--engine-sessions", "--tombstones", "7"])
    config = config_from_args(args)
    assert (config.max_rollback, config.engine_sessions, config.tombstones) == (3, True, 7)
    given = vars(args)
    for field in dataclasses.fields(ServerConfig):
        if field.name in given:
            assert getattr(config, field.name) == given[field.name], field.name


def test_engine_url_repeats_for_data_parallel_workers() -> None:
    args = build_parser().parse_args([*REQUIRED, "--engine-url", "http://127.0.0.1:2/"])
    config = config_from_args(args)
    assert config.engine_url == "http://127.0.0.1:1"
    assert config.engine_bases == ("http://127.0.0.1:1", "http://127.0.0.1:2")


def test_replica_name_is_the_prefix_of_minted_ids() -> None:
    assert config_from_args(build_parser().parse_args(REQUIRED)).session_id_prefix == ""
    config = config_from_args(build_parser().parse_args([*REQUIRED, "--replica-name", "pod-3"]))
    assert config.session_id_prefix == "pod-3."
    for bad in ("Pod", "3pod", "a.b", "", "x" * 33):
        with pytest.raises(ValueError, match="--replica-name"):
            config_from_args(build_parser().parse_args([*REQUIRED, "--replica-name", bad]))


_CLI_LOAD = """
import json, sys
from session_server.cli import load_family
family = load_family(sys.argv[1], sys.argv[2], without_torch=True)
messages = json.loads(sys.argv[3])
text = family.render(messages, None, add_generation_prompt=True)
json.dump({"torch": "torch" in sys.modules, "class": type(family.tokenizer).__qualname__, "text": text,
           "ids": family.tokenizer.encode(text, add_special_tokens=False)}, sys.stdout)
"""


@pytest.mark.parametrize("name", FAMILIES)
def test_the_cli_loads_the_same_tokenizer_without_importing_torch(
    tokenizer_dirs: dict[str, Path], hf_tokenizers: dict[str, Any], name: str
) -> None:
    """The server's start-up (`main`) loads transformers in its tokenizer-only mode: torch is never imported, the
    tokenizer is the class AutoTokenizer picks with torch around, and it renders and tokenizes identically."""
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "ünï 中文 😀 <think> {\"a\": 1}"},
                {"role": "assistant", "content": "ok\n\n  done"},
                {"role": "user", "content": "again\t<|im_end|>"}]
    run = subprocess.run([sys.executable, "-c", _CLI_LOAD, str(tokenizer_dirs[name]), name, json.dumps(messages)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    got = json.loads(run.stdout)
    tokenizer = hf_tokenizers[name]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == {"torch": False, "class": type(tokenizer).__qualname__, "text": text,
                   "ids": tokenizer.encode(text, add_special_tokens=False)}
