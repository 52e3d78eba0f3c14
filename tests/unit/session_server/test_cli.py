"""The CLI and ServerConfig agree by construction: a flag's default is its config field's default, and every flag
named like a config field reaches the config (nothing is parsed and then dropped)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from session_server.cli import (
    ENGINE_ADMIN_API_KEY_ENV,
    ENGINE_API_KEY_ENV,
    _default,
    build_parser,
    config_from_args,
    flags,
)
from session_server.config import ServerConfig
from session_server.engine import pacing

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


def test_first_turn_cache_budget() -> None:
    assert config_from_args(build_parser().parse_args(REQUIRED)).first_turn_cache_tokens > 0  # on by default
    config = config_from_args(build_parser().parse_args([*REQUIRED, "--first-turn-cache-tokens", "0"]))
    assert config.first_turn_cache_tokens == 0  # keeps none
    with pytest.raises(ValueError, match="--first-turn-cache-tokens"):
        config_from_args(build_parser().parse_args([*REQUIRED, "--first-turn-cache-tokens", "-1"]))


def test_each_flag_parses_to_its_fields_type() -> None:
    """The flag table gives no types: an int or float field's flag parses numbers as such, a bool field's is a switch,
    a field without a default is a required flag."""
    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    hints = typing.get_type_hints(ServerConfig)
    checked = set()
    for flag in flags():
        if flag.dest not in fields:
            continue
        kind = hints[flag.dest]
        if kind is bool:
            assert getattr(build_parser().parse_args([*REQUIRED, flag.option]), flag.dest) is True, flag.option
        elif kind in (int, float):
            value = getattr(build_parser().parse_args([*REQUIRED, flag.option, "7"]), flag.dest)
            assert type(value) is kind and value == 7, flag.option
        checked.add(kind)
    assert checked >= {bool, int, float}
    for option in ("--engine-url", "--tokenizer", "--model-family"):
        i = REQUIRED.index(option)
        with pytest.raises(SystemExit):
            build_parser().parse_args(REQUIRED[:i] + REQUIRED[i + 2:])


def test_engine_keys_default_to_the_environment_when_the_parser_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "k-from-env")
    monkeypatch.delenv(ENGINE_ADMIN_API_KEY_ENV, raising=False)
    config = config_from_args(build_parser().parse_args(REQUIRED))
    assert (config.engine_api_key, config.engine_admin_api_key) == ("k-from-env", None)


def test_the_stream_chunk_rule_is_two_flags() -> None:
    """The agent's chunks (engine/pacing.py): by default a chunk per CHUNK_SECONDS or CHUNK_TOKENS; both flags reach
    the config, and an impossible value is refused by name."""
    config = config_from_args(build_parser().parse_args(REQUIRED))
    assert (config.stream_chunk_ms, config.stream_chunk_tokens) == (pacing.CHUNK_SECONDS * 1000, pacing.CHUNK_TOKENS)
    config = config_from_args(build_parser().parse_args([*REQUIRED, "--stream-chunk-ms", "50",
                                                         "--stream-chunk-tokens", "64"]))
    assert (config.stream_chunk_ms, config.stream_chunk_tokens) == (50.0, 64)
    for flag, bad in (("--stream-chunk-ms", "-1"), ("--stream-chunk-tokens", "0")):
        with pytest.raises(ValueError, match=flag):
            config_from_args(build_parser().parse_args([*REQUIRED, flag, bad]))
