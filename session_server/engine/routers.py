"""What stands at an `--engine-url`: an SGLang engine, or a router in front of several, and what each router breaks.

Measured with two real SGLang 0.5.23 engines behind each router (tests/sglang/test_real_routers.py; the same against
sims in tests/e2e/test_engine_router.py and test_engine_smg.py):

- both routers proxy `/generate`, plain and streamed, keep a session on one engine by `X-SMG-Routing-Key` (sglang-router
  under `--policy manual`; smg under `manual`, `consistent_hashing` or `--routing-key-override`), and drop their
  request to the engine when the caller closes its connection, so SGLang aborts it (a streamed one at once, a plain
  one within its disconnect check, ~4 s) and frees its KV;
- both answer 404 to `/abort_request`, `/open_session`, `/close_session`, `/pause_generation`,
  `/continue_generation` and `/update_weights_from_disk`; sglang-router 0.3.2 also rebuilds the `/generate` body
  without `return_routed_experts`;
- smg (1.13) started with `--enable-rl` forwards any engine path to every engine as `POST
  /v1/rl/engine/{path}?selector=engine=sglang`, body unchanged, and answers one aggregate (`results` per engine,
  `succeeded`, `total`, `failed`; 200 when every engine answered 2xx, 207 otherwise).

So behind smg `--enable-rl` the server sends its control calls through that fan-out (`EngineClient.fan_out`): an
abort reaches the engine that runs the rid (the others ignore an unknown rid), `/admin/pause` `in_place` pauses every
engine, and an engine session is opened under the server's own id on every engine and closed on every engine -- the
routing key sends each turn to one of them, and the others hold an empty session (no KV) until it is closed or times
out. Behind the other routers the features that need those calls are refused at startup (`refusal`); aborts still free
the KV there, by closing the connection (engine/drains.py).

How a router is told from an engine: sglang-router's `/get_server_info` says `router_manager`; smg answers `GET
/workers` with its worker list (an engine has no such route) and, with `--enable-rl`, `GET /v1/rl/workers`.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any

import httpx
import msgspec


class EngineKind(enum.StrEnum):
    ENGINE = "an SGLang engine"
    SGLANG_ROUTER = "sglang-router"
    SMG = "smg without --enable-rl"
    SMG_RL = "smg --enable-rl"

    @property
    def is_router(self) -> bool:
        return self is not EngineKind.ENGINE


RL_FAN_OUT = "/v1/rl/engine"
RL_SELECTOR = "engine=sglang"


def fan_out_path(path: str) -> str:
    """smg's RL fan-out of an engine path (`/abort_request` -> every engine's `/abort_request`)."""
    return f"{RL_FAN_OUT}{path}?selector={RL_SELECTOR}"


def unpack_fan_out(status: int, body: bytes) -> tuple[int, bytes]:
    """smg's aggregate reply as one engine's: (200, the first engine's body) when every engine answered 2xx, else the
    first failing engine's status and body (or smg's own error when it reached none)."""
    try:
        agg = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return status, body
    results = agg.get("results") if isinstance(agg, dict) else None
    if not isinstance(results, dict) or not results:
        return (status if status >= 400 else 502), body
    answers = [r for r in results.values() if isinstance(r, dict)]
    failed = [r for r in answers if not (isinstance(r.get("status"), int) and 200 <= r["status"] < 300)]
    first = failed[0] if failed else answers[0]
    inner = first.get("body", "")
    encoded = b"" if inner == "" else msgspec.json.encode(inner)  # SGLang's empty 200 (abort, close) stays empty
    return (int(first.get("status") or 502) if failed else 200), encoded


async def classify(probe: httpx.AsyncClient, url: str) -> EngineKind:
    """What answers at `url` (httpx errors propagate: the caller decides what an unreachable engine means)."""
    info = await _get_json(probe, url + "/get_server_info")
    if isinstance(info, dict) and "router_manager" in info:
        return EngineKind.SGLANG_ROUTER
    workers = await _get_json(probe, url + "/workers")
    if not (isinstance(workers, dict) and isinstance(workers.get("workers"), list)):
        return EngineKind.ENGINE
    rl = await _get_json(probe, url + "/v1/rl/workers")
    return EngineKind.SMG_RL if isinstance(rl, dict) and isinstance(rl.get("workers"), list) else EngineKind.SMG


async def _get_json(probe: httpx.AsyncClient, url: str) -> Any:
    resp = await probe.get(url)
    if resp.status_code != 200:
        return None
    with contextlib.suppress(msgspec.DecodeError):
        return msgspec.json.decode(resp.content)
    return None


# The flags a router breaks, and why, by router.
BROKEN: dict[EngineKind, dict[str, str]] = {
    EngineKind.SGLANG_ROUTER: {
        "--engine-sessions": "sglang-router 0.3.2 answers /open_session and /close_session 404",
        "--return-routed-experts": "sglang-router 0.3.2 rebuilds the /generate body without return_routed_experts",
    },
    EngineKind.SMG: {
        "--engine-sessions": "smg answers /open_session and /close_session 404 unless started with --enable-rl, "
                             "whose fan-out the server then uses",
    },
}


def refusal(kinds: dict[str, EngineKind], *, engine_sessions: bool, return_routed_experts: bool) -> str | None:
    """The startup error for flags a router in front of the engines would silently break, or None."""
    wanted = [flag for flag, on in (("--engine-sessions", engine_sessions),
                                    ("--return-routed-experts", return_routed_experts)) if on]
    problems = [f"--engine-url {url} is a router ({kind}), not an SGLang engine: {flag} needs what it breaks: "
                f"{BROKEN[kind][flag]}"
                for url, kind in kinds.items() for flag in wanted if flag in BROKEN.get(kind, {})]
    if not problems:
        return None
    return ("; ".join(problems) + ". Give each engine's own URL with --engine-url (repeat the flag for several: the "
            "session server places sessions itself), or put smg --enable-rl in front of them")
