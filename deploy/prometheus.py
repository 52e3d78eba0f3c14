"""`python -m deploy.prometheus --replica r0=HOST:PORT ... > session-server.yml`: a Prometheus scrape job over every
replica, each target labelled with its replica name (so dashboards sum over replicas or pick one). Written as JSON,
which is YAML too: Prometheus reads it as it is, and no YAML library is needed.

Every replica is scraped directly, never through nginx: through the balancer each scrape would reach whichever
replica nginx picked, and the series would jump between processes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from .replicas import Replica, add_output_flag, add_replica_flag, check_unique, emit_config


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
    add_output_flag(p)
    args = p.parse_args(argv)
    return emit_config(p, args.out, lambda: scrape_config(args.replicas, job=args.job, interval=args.interval))


if __name__ == "__main__":
    raise SystemExit(main())
