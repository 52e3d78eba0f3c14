"""The replica list of a deployment: `--replica NAME=HOST:PORT`, one per `session-server --replica-name NAME`.

The name is the routing key of every session the replica mints (`NAME.<hex>`, session_server/sessions/registry.py),
so it must be the replica's `--replica-name` and must stay with the replica's address and journal across restarts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from session_server.config import REPLICA_NAME


@dataclass(frozen=True, slots=True)
class Replica:
    name: str
    host: str
    port: int

    @property
    def address(self) -> str:
        """`host:port` as nginx's `server` and Prometheus' targets write it."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def parse_replica(spec: str) -> Replica:
    """`NAME=HOST:PORT` (argparse type: a bad spec is a usage error that says what is wrong)."""
    name, sep, address = spec.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--replica wants NAME=HOST:PORT, got {spec!r}")
    if not REPLICA_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"replica name {name!r}: 1-32 characters of a-z 0-9 -, starting with a letter (its --replica-name)"
        )
    return Replica(name, host, int(port))


def check_unique(replicas: Sequence[Replica]) -> None:
    """Two replicas under one name or one address would split a session's traffic: a ValueError that names them."""
    for what, keys in (("name", [r.name for r in replicas]), ("address", [r.address for r in replicas])):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"replica {what} given twice: {', '.join(twice)}")


def add_replica_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica", dest="replicas", action="append", type=parse_replica, required=True, metavar="NAME=HOST:PORT",
        help="a session-server replica started with --replica-name NAME on HOST:PORT; repeat for each",
    )


def add_output_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--out", type=Path, help="write here instead of stdout")


def emit_config(parser: argparse.ArgumentParser, out: Path | None, render: Callable[[], str]) -> int:
    """A config command's end: `render()` written to `out` (or stdout); a ValueError it raises is a usage error."""
    try:
        text = render()
    except ValueError as exc:
        parser.error(str(exc))
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
    return 0
