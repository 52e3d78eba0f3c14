"""Fixtures of the real-engine tier: the run's shared SGLang engines (tests/support/sglang_engine.py) and, per module,
session servers in front of them (through a recording proxy, so that a test compares what was stored with what the
real engine received and returned)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.launchers import start_session_server
from support.server import RecordingProxy
from support.sglang_engine import SPECS, Engines, Served, ServeFactory, assert_engine_clean

FAMILY = "qwen3"
HERE = Path(__file__).resolve().parent
# A test's setup includes the launch of the engine it is the first to need: 40 s on an idle machine, minutes on a
# loaded one (seen: 150 s at a load average of 18 on 2 cores). The suite's 300 s default is for loopback sims.
ENGINE_TEST_TIMEOUT = 1200


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT))


@pytest.fixture(scope="session")
def engines(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    venv: Path = pytestconfig.getoption("--sglang-venv")
    python = venv.resolve() / "bin" / "python"
    assert python.exists(), f"{python} missing: `make test-sglang` installs the real engine's venv"
    pool = Engines(python, pytestconfig.getoption("--checkpoints").resolve(), tmp_path_factory.mktemp("engines"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def serve(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> ServeFactory:
    """`with serve("dense", "--engine-sessions") as s:` -- a session server (these args) in front of the shared engine,
    through a recording proxy unless `proxied=False` (`s.proxy` is then None); on exit the server must stop cleanly
    and the engine hold nothing (no request, no session, no KV)."""

    @contextlib.contextmanager
    def factory(engine_name: str, *args: str, proxied: bool = True) -> Iterator[Served]:
        engine = engines.get(engine_name)
        checkpoint = engines.checkpoint(SPECS[engine_name].checkpoint)
        proxy = RecordingProxy(engine.url) if proxied else None
        logs = tmp_path_factory.mktemp("served")
        proc = start_session_server(engine.url if proxy is None else proxy.url, checkpoint, FAMILY, *args,
                                    log_dir=logs)
        try:
            yield Served(proc.url, engine.url, proxy, proc, checkpoint)  # type: ignore[arg-type]
        finally:
            try:
                proc.close()
            finally:
                if proxy is not None:
                    proxy.close()
        assert_engine_clean(engines.get(engine_name).url)

    return factory
