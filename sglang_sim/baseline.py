"""What "the engine is back at its baseline" means, in one place for everyone who checks it: the soaks
(soaks/soak.py, soaks/crash_soak.py) and the session-server tests (tests/support/server.py).

Once every session is deleted nothing may be left behind: no request running or waiting, no engine session open, no
KV slot in use after `POST /flush_cache` (only the radix cache may still hold KV before the flush), and the engine's
own books (`GET /sim/books`) balance. The checks are pure functions of what the caller fetched, so synchronous tests
and asynchronous soaks share them.
"""

from __future__ import annotations

import json
from typing import Any


def engine_idle(info: dict[str, Any]) -> bool:
    """Nothing runs or waits, by the engine's `/server_info`."""
    return not info["running_requests"] and not info["waiting_requests"]


def baseline_problems(
    idle: dict[str, Any], flush_status: int, flushed: dict[str, Any], books: dict[str, Any], *, open_sessions: int = 0
) -> list[tuple[str, str]]:
    """(kind, detail) of every way the engine is not at its baseline; empty when it is.

    `idle`: `/server_info` once the caller waited for the engine to go idle; `flush_status` and `flushed`: the status
    of `POST /flush_cache` and `/server_info` after it; `books`: `GET /sim/books`. `open_sessions`: engine sessions
    that are meant to be open still (their KV is then not expected back)."""
    problems = []
    if not engine_idle(idle):
        problems.append(("engine_leak", f"running={idle['running_requests']} waiting={idle['waiting_requests']}"))
    if idle["open_sessions"] != open_sessions:
        problems.append(("engine_session_leak", f"open_sessions={idle['open_sessions']}, expected {open_sessions}"))
    if flush_status != 200:
        problems.append(("flush_cache_failed", f"POST /flush_cache answered {flush_status}"))
    if open_sessions == 0 and flushed["kv_used_tokens"]:
        problems.append(("engine_kv_leak", f"kv_used_tokens={flushed['kv_used_tokens']} after flush_cache"))
    if not books.get("ok"):
        problems.append(("engine_books", json.dumps(books)[:300]))
    return problems
