"""Each package's public surface is exactly what its `__init__` exports (as httpx pins its own): a name is public
only when it is in `__all__`, and everything in `__all__` resolves. Subpackages of the server are internal rooms of
one house and export nothing."""

from __future__ import annotations

import importlib
import pkgutil
import types
import typing

import pytest

PACKAGES = {
    "trajectory": None,
    "rollout": None,
    "sglang_sim": (),
    "harness": (),  # the loopback harness: its modules are imported by name (harness.launchers, ...)
    "session_server": ("ServerConfig", "build_app"),
}


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_all_resolves_and_is_the_public_surface(name: str) -> None:
    package = importlib.import_module(name)
    exported = tuple(getattr(package, "__all__", ()))
    expected = PACKAGES[name]
    if expected is not None:
        assert sorted(exported) == sorted(expected)
    for member in exported:
        assert getattr(package, member) is not None, member
    submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    public = {
        n for n, v in vars(package).items()
        if not n.startswith("_") and n not in submodules and not _plumbing(n, v)
    }
    assert public <= set(exported), f"public but not exported: {sorted(public - set(exported))}"


def _plumbing(name: str, value: object) -> bool:
    """What an `__init__` needs to work but does not offer: imported modules and typing helpers."""
    return isinstance(value, types.ModuleType) or name == "annotations" or getattr(typing, name, None) is value


@pytest.mark.parametrize("sub", ["api", "chat", "engine", "http", "messages", "responses", "sessions", "turns"])
def test_server_subpackages_export_nothing(sub: str) -> None:
    package = importlib.import_module(f"session_server.{sub}")
    submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert {n for n in vars(package) if not n.startswith("_")} - submodules - {"annotations"} == set()
