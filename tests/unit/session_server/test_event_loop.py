"""What keeps the single event loop responsive: work routed by body size (small inline, large on the bounded pool)
and a startup heap frozen out of the garbage collector's full passes."""

from __future__ import annotations

import asyncio
import gc
import threading

from session_server.cpu_pool import CpuPool


def _thread_name() -> str:
    return threading.current_thread().name


def test_small_bodies_run_inline_and_large_ones_on_the_pool() -> None:
    async def main() -> dict[str, str]:
        pool = CpuPool(2, inline_below_bytes=1024)
        try:
            return {
                "loop": _thread_name(),
                "small": await pool.run_sized(1023, _thread_name),
                "large": await pool.run_sized(1024, _thread_name),
                "always": await pool.run(_thread_name),
                "decode_small": await pool.run_decode(10, _thread_name),
                "decode_large": await pool.run_decode(10_000, _thread_name),
            }
        finally:
            pool.shutdown()

    seen = asyncio.run(main())
    assert seen["small"] == seen["loop"] == seen["decode_small"]
    for key in ("large", "always", "decode_large"):
        assert seen[key].startswith("session-cpu"), seen


def test_zero_cut_pools_everything_and_inline_decode_pools_no_decode() -> None:
    async def main() -> tuple[str, str, str, str]:
        pooled, inline = CpuPool(1, inline_below_bytes=0), CpuPool(1, inline_decode=True)
        try:
            return (_thread_name(), await pooled.run_sized(0, _thread_name),
                    await inline.run_decode(10**9, _thread_name), await inline.run_sized(10**9, _thread_name))
        finally:
            pooled.shutdown()
            inline.shutdown()

    loop, zero_cut, inline_decode, inline_sized = asyncio.run(main())
    assert zero_cut.startswith("session-cpu")
    assert inline_decode == loop
    assert inline_sized.startswith("session-cpu")  # --inline-decode is about engine replies only


def test_startup_heap_is_frozen_out_of_full_collections(tokenizer_dirs, families) -> None:
    """Full collections under load walked the tokenizer's millions of objects (50-140 ms loop stalls); the lifespan
    freezes everything allocated before serving so they never do."""
    from starlette.testclient import TestClient

    from session_server.app import build_app
    from session_server.config import ServerConfig

    family = families["qwen3"]  # the suite's own, already loaded: allocated before serving as the server's would be
    config = ServerConfig(engine_url="http://127.0.0.1:9", tokenizer=str(tokenizer_dirs["qwen3"]), model_family="qwen3")
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        with TestClient(build_app(config, family)) as client:
            assert client.get("/health").status_code == 200
            assert gc.get_freeze_count() > 100_000  # the loaded tokenizer and libraries, out of the GC's walks
    finally:
        gc.freeze()  # the test process's heap stays out of full collections too (tests/conftest.py `kept`)
