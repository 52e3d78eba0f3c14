"""The sim's API-key rules against SGLang 0.5.23's own decision function (sglang/srt/utils/auth.py
`decide_request_auth`, which the sim copies) and the `@auth_level` marks of sglang/srt/entrypoints/http_server.py."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

from sglang_sim.auth import ADMIN_OPTIONAL_PATHS, allowed
from support.sglang_real import sglang_root

SGLANG = Path(sglang_root())


def _load_auth():  # type: ignore[no-untyped-def]
    """auth.py is self-contained (stdlib only, "no torch import"): load the file itself, not the sglang package."""
    spec = importlib.util.spec_from_file_location("sglang_auth_oracle", SGLANG / "srt" / "utils" / "auth.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


sglang_auth = _load_auth()

PATHS = ["/generate", "/open_session", "/close_session", "/server_info", "/v1/models", "/model_info",
         *sorted(ADMIN_OPTIONAL_PATHS), "/health", "/health_generate", "/ready", "/metrics"]
KEYS = [None, "k-api", "k-admin"]
HEADERS = [None, "Bearer k-api", "Bearer k-admin", "bearer k-admin", "Bearer wrong", "k-api", "Basic k-api"]


def _level(path: str) -> object:
    return sglang_auth.AuthLevel.ADMIN_OPTIONAL if path in ADMIN_OPTIONAL_PATHS else sglang_auth.AuthLevel.NORMAL


def test_admin_optional_paths_are_the_ones_sglang_marks() -> None:
    """Every path the sim treats as ADMIN_OPTIONAL carries @auth_level(AuthLevel.ADMIN_OPTIONAL) in http_server.py,
    and the NORMAL ones the server calls carry no mark."""
    source = (SGLANG / "srt" / "entrypoints" / "http_server.py").read_text()
    lines = source.splitlines()
    marked = set()
    for i, line in enumerate(lines):
        if line.startswith("@auth_level(AuthLevel.ADMIN_OPTIONAL)"):
            route = lines[i - 1]
            marked.add(route.split('"')[1])
    assert marked >= ADMIN_OPTIONAL_PATHS
    for path in ("/generate", "/open_session", "/close_session"):
        assert path not in marked


@pytest.mark.parametrize("api_key,admin_key", [(a, b) for a, b in itertools.product(KEYS, KEYS)
                                               if a != "k-admin" and b != "k-api"])
def test_sim_decides_exactly_like_sglang(api_key: str | None, admin_key: str | None) -> None:
    for path, header, method in itertools.product(PATHS, HEADERS, ("GET", "POST")):
        want = sglang_auth.decide_request_auth(method=method, path=path, authorization_header=header,
                                               api_key=api_key, admin_api_key=admin_key, auth_level=_level(path))
        assert allowed(method, path, header, api_key, admin_key) == want.allowed, (path, header, api_key, admin_key)
