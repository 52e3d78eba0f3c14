"""`session-server-admin`: one call over every replica of a deployment, with each replica's result.

A weight update needs every replica paused, not the one nginx happens to pick, and an operator needs to see which
replica did not answer: so each command goes to every `--replica` directly (not through the balancer), at once, and
prints one line per replica; a replica that does not answer, answers an error, or reports another name than the one
it is listed under (the balancer would route its ids elsewhere) is a failure, named, and the exit code is 1.

    session-server-admin --replica r0=10.0.0.1:8000 --replica r1=10.0.0.2:8000 pause --mode drain
    session-server-admin ... continue | health | metrics | sessions      (--json for machine-readable output)

The admin token (if the replicas run with --admin-token) comes from --admin-token or $SESSION_SERVER_ADMIN_TOKEN.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .replicas import Replica, add_replica_flag, check_unique

PROG = "session-server-admin"
TOKEN_ENV = "SESSION_SERVER_ADMIN_TOKEN"
# The live-state gauges and lifecycle counters `metrics` shows per replica (session_server/metrics.py names them).
METRICS = ("sessions", "in_flight", "paused", "sessions_created_total", "sessions_deleted_total", "engines_healthy")
PREFIX = "session_server_"
CHAT_ROUTE = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One replica's answer to one command: `value` when it answered as expected, else `error` says why not."""

    replica: Replica
    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class Command:
    method: str
    path: str
    summary: Callable[[Any], str]  # one line from the replica's answer
    body: dict[str, Any] | None = None
    json_reply: bool = True  # False: the reply is text (Prometheus exposition), parsed by `parse`
    parse: Callable[[str], Any] | None = None


def metric_values(text: str) -> dict[str, float]:
    """What `metrics` shows of a /metrics exposition: the METRICS samples (summed over labels), `chats` (chat
    completions answered 200, by session URL or at the root) and `errors` (responses with a 5xx status)."""
    values: dict[str, float] = {"chats": 0.0, "errors": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if not sample.name.startswith(PREFIX):
                continue
            if name in METRICS:
                values[name] = values.get(name, 0.0) + sample.value
            elif name == "responses_total":
                status, route = sample.labels["status"], sample.labels["route"]
                values["chats"] += sample.value if status == "200" and route.endswith(CHAT_ROUTE) else 0.0
                values["errors"] += sample.value if status.startswith("5") else 0.0
    return values


def _pause_summary(v: Any) -> str:
    return f"{v['status']} ({v['mode']}, {v['aborted']} aborted)"


def _health_summary(v: Any) -> str:
    paused = ", paused" if v.get("paused") else ""  # a replica restarted during a pause comes back paused
    return f"{v['status']}{paused}, instance {v['instance_id']}"


def _metrics_summary(v: Any) -> str:
    return ", ".join(f"{k} {v[k]:g}" for k in (*METRICS, "chats", "errors") if k in v)


def _sessions_summary(v: Any) -> str:
    live = v["sessions"]
    busy = sum(1 for s in live if s.get("in_flight"))
    return f"{len(live)} sessions, {busy} with a chat in flight"


CONTINUE = Command("POST", "/admin/continue", lambda v: str(v["status"]))
HEALTH = Command("GET", "/health", _health_summary)
METRICS_TEXT = Command("GET", "/metrics", _metrics_summary, json_reply=False, parse=metric_values)
SESSIONS = Command("GET", "/admin/sessions", _sessions_summary)


def pause(mode: str) -> Command:
    return Command("POST", "/admin/pause", _pause_summary, body={"mode": mode})


def command(args: argparse.Namespace) -> Command:
    fixed = {"continue": CONTINUE, "health": HEALTH, "metrics": METRICS_TEXT, "sessions": SESSIONS}
    return pause(args.mode) if args.command == "pause" else fixed[args.command]


async def _one(http: httpx.AsyncClient, replica: Replica, cmd: Command, headers: dict[str, str]) -> Outcome:
    try:
        reply = await http.request(cmd.method, replica.url + cmd.path, json=cmd.body, headers=headers)
    except httpx.TimeoutException:
        return Outcome(replica, error=f"no answer within {http.timeout.read}s")
    except httpx.TransportError as exc:
        return Outcome(replica, error=f"unreachable: {type(exc).__name__}: {exc or 'connection failed'}")
    if reply.status_code != 200:
        return Outcome(replica, error=f"HTTP {reply.status_code}: {reply.text[:300].strip()}")
    try:
        value: Any = reply.json() if cmd.json_reply else cmd.parse(reply.text) if cmd.parse else reply.text
    except ValueError as exc:
        return Outcome(replica, error=f"unreadable answer: {exc}")
    if cmd is HEALTH and value.get("replica") != replica.name:
        return Outcome(replica, value, error=(
            f"answers as replica {value.get('replica')!r}, not {replica.name!r}: the balancer routes {replica.name}.* "
            f"ids to this address (start it with --replica-name {replica.name})"))
    return Outcome(replica, value)


async def run(replicas: Sequence[Replica], cmd: Command, *, token: str | None, seconds: float) -> list[Outcome]:
    """`cmd` on every replica at once, waiting `seconds` for each; one Outcome each, in the order given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=seconds) as http:
        return list(await asyncio.gather(*(_one(http, r, cmd, headers) for r in replicas)))


def report(outcomes: Sequence[Outcome], cmd: Command, as_json: bool) -> str:
    if as_json:
        return json.dumps({o.replica.name: {"address": o.replica.address, "ok": o.ok, "value": o.value,
                                            "error": o.error} for o in outcomes}, indent=2)
    width = max(len(o.replica.name) for o in outcomes)
    addr = max(len(o.replica.address) for o in outcomes)
    lines = [
        f"{o.replica.name:<{width}}  {o.replica.address:<{addr}}  "
        + (f"ok    {cmd.summary(o.value)}" if o.ok else f"FAIL  {o.error}")
        for o in outcomes
    ]
    failed = [o.replica.name for o in outcomes if not o.ok]
    lines.append(f"{len(outcomes) - len(failed)}/{len(outcomes)} replicas ok"
                 + (f"; failed: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_replica_flag(p)
    p.add_argument("--admin-token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"the replicas' --admin-token (default: ${TOKEN_ENV})")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for each replica (default: 10, pause: 120, above the --drain-timeout)")
    p.add_argument("--json", action="store_true", help="one JSON object, replica name -> answer")
    sub = p.add_subparsers(dest="command", required=True)
    pause = sub.add_parser("pause", help="POST /admin/pause on every replica (new chats get 503 + Retry-After)")
    pause.add_argument("--mode", default="drain",
                       help="drain: wait for chats that reached the engine, then abort the rest at --drain-timeout; "
                            "abort: abort them now; in_place where the replicas offer it (default drain)")
    sub.add_parser("continue", help="POST /admin/continue on every replica")
    sub.add_parser("health", help="GET /health of every replica (and that each is the replica it is listed as)")
    sub.add_parser("metrics", help="live sessions, chats in flight, pause and lifecycle counters of every replica")
    sub.add_parser("sessions", help="GET /admin/sessions of every replica: its live sessions")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_unique(args.replicas)
    except ValueError as exc:
        parser.error(str(exc))
    cmd = command(args)
    timeout = args.timeout if args.timeout is not None else 120.0 if args.command == "pause" else 10.0
    outcomes = asyncio.run(run(args.replicas, cmd, token=args.admin_token, seconds=timeout))
    sys.stdout.write(report(outcomes, cmd, args.json) + "\n")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
