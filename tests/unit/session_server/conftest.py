"""The server's unit tests run on the Qwen3 family unless a module asks for others (its own `family` fixture)."""

from __future__ import annotations

import pytest

from trajectory import ModelFamily


@pytest.fixture(scope="module")
def family(families: dict[str, ModelFamily]) -> ModelFamily:
    return families["qwen3"]
