"""`python -m deploy.prometheus --replica r0=HOST:PORT ... > session-server.yml`: a Prometheus scrape job over every
replica, each target labelled with its replica name (so dashboards sum over replicas or pick one). Written as JSON,
which is YAML too: Prometheus reads it as it is, and no YAML library is needed.

Every replica is scraped directly, never through nginx: through the balancer each scrape would reach whichever
replica nginx picked, and the series would jump between processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .replicas import Replica, add_replica_flag, check_unique


def scrape_config(replicas: Sequence[Replica], *, job: str = "session-server", interval: str = "15s") -> str:
    """A `scrape_configs` document for `replicas`: paste it into prometheus.yml or load it as a file."""
    check_unique(replicas)
    doc = {"scrape_configs": [{
        "job_name": job,
        "scrape_interval": interval,
        "metrics_path": "/metrics",
        "static_configs": [{"targets": [r.address], "labels": {"replica": r.name}} for r in replicas],
    }]}
    return json.dumps(doc, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.prometheus", description=__doc__.split("\n\n")[0])
    add_replica_flag(p)
    p.add_argument("--job", default="session-server", help="the job name (default %(default)s)")
    p.add_argument("--interval", default="15s", help="scrape interval (default %(default)s)")
    p.add_argument("-o", "--out", type=Path, help="write here instead of stdout")
    args = p.parse_args(argv)
    try:
        text = scrape_config(args.replicas, job=args.job, interval=args.interval)
    except ValueError as exc:
        p.error(str(exc))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
