"""The CPU pool routes work by body size: small bodies inline on the loop, large ones on the bounded pool."""

from __future__ import annotations

import asyncio
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
