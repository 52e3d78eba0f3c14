"""`python -m deploy.nginx --replica r0=HOST:PORT --replica r1=HOST:PORT ... > nginx.conf`: the nginx config for
N session-server replicas (nginx.conf.j2 says how it routes, and why).

How a new session lands on the replica that will own it: the balancer sends `POST /sessions` to the least busy
replica, which mints the id with its own name in front (`r1.<hex>`); every later request naming that id -- in the
path, in X-Session-ID -- is mapped back to `r1` by name. We chose this over ids minted to hash back to their replica
under the balancer's consistent hash: a hash ring changes when a replica joins, and then ~1/N of live sessions
would land on a replica that does not know them; a name in the id never moves. Ids a client chooses itself (root-URL
chats with X-Session-ID and --create-sessions-on-demand) carry no name, so those are placed by consistent hashing
over `--ring` (default: every replica); keep the ring fixed while such sessions live. A fork's children (POST
/sessions/{id}/fork, routed by the parent's id) are minted by the parent's replica, so they carry its name and live
there with the history they share, whatever placed the parent (tests/e2e/test_cluster_nginx.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import jinja2

from .replicas import Replica, add_output_flag, add_replica_flag, check_unique, emit_config

TEMPLATE = Path(__file__).with_name("nginx.conf.j2")


def render_nginx(
    replicas: Sequence[Replica],
    *,
    listen: str = "8000",
    ring: Sequence[str] | None = None,
    workers: str = "auto",
    worker_connections: int = 4096,
    keepalive: int = 64,
    read_timeout: int = 3600,
    runtime_dir: Path | None = None,
    error_log: str = "stderr",
    log_level: str = "warn",
    user: str | None = None,
) -> str:
    """The config text. `ring`: replica names that place client-chosen ids (default all). `runtime_dir`: where the
    pid file and temp directories go (default: nginx's compiled-in paths, for a system nginx). `read_timeout`: the
    longest a chat may take (keep it above the replicas' --request-timeout)."""
    if not replicas:
        raise ValueError("at least one --replica")
    check_unique(replicas)
    names = [r.name for r in replicas]
    ring = list(names if ring is None else ring)
    unknown = sorted(set(ring) - set(names))
    if unknown:
        raise ValueError(f"--ring names no replica: {', '.join(unknown)}")
    if not ring:
        raise ValueError("the ring needs at least one replica")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent), undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True, keep_trailing_newline=True, autoescape=False,
    )
    return env.get_template(TEMPLATE.name).render(
        replicas=replicas, ring=ring, listen=listen, workers=workers, worker_connections=worker_connections,
        keepalive=keepalive, read_timeout=read_timeout, runtime_dir=runtime_dir, error_log=error_log,
        log_level=log_level, user=user,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.nginx", description=__doc__.split("\n\n")[0])
    add_replica_flag(p)
    p.add_argument("--listen", default="8000", help="nginx's listen address, e.g. 8000 or 0.0.0.0:8000")
    p.add_argument("--ring", action="append", metavar="NAME",
                   help="a replica that places client-chosen ids by consistent hashing; repeat (default: all)")
    p.add_argument("--workers", default="auto", help="nginx worker processes (default auto: one per core)")
    p.add_argument("--read-timeout", type=int, default=3600,
                   help="seconds a chat may take; above the replicas' --request-timeout (default %(default)s)")
    p.add_argument("--runtime-dir", type=Path, help="directory for the pid file and temp files (default: nginx's)")
    add_output_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return emit_config(parser, args.out, lambda: render_nginx(
        args.replicas, listen=args.listen, ring=args.ring, workers=args.workers, read_timeout=args.read_timeout,
        runtime_dir=args.runtime_dir,
    ))


if __name__ == "__main__":
    raise SystemExit(main())
