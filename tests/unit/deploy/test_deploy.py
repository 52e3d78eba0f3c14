"""deploy/: the replica list, the generated nginx and Prometheus configs, the admin CLI's reading of /metrics (the
routing and the admin plane are proven against real replicas and the real nginx in tests/e2e/test_cluster_nginx.py;
here, what the generators refuse and that nginx itself accepts what it writes)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from deploy.admin import metric_values
from deploy.nginx import main, render_nginx
from deploy.prometheus import scrape_config
from deploy.replicas import Replica, parse_replica
from harness.launchers import nginx_binary


def test_replica_specs() -> None:
    assert parse_replica("r0=10.0.0.1:8000") == Replica("r0", "10.0.0.1", 8000)
    assert parse_replica("pod-7=[::1]:9") == Replica("pod-7", "[::1]", 9)
    for bad in ("r0", "r0=host", "r0=host:0", "r0=host:x", "=h:1", "R0=h:1", "r.0=h:1", "0r=h:1", "r0=:80"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_replica(bad)


def test_the_generator_refuses_what_would_split_a_session() -> None:
    a, b = Replica("a", "h", 1), Replica("b", "h", 2)
    with pytest.raises(ValueError, match="replica name given twice: a"):
        render_nginx([a, Replica("a", "h", 3)])
    with pytest.raises(ValueError, match="replica address given twice: h:1"):
        render_nginx([a, Replica("c", "h", 1)])
    with pytest.raises(ValueError, match="--ring names no replica: z"):
        render_nginx([a, b], ring=["a", "z"])
    with pytest.raises(ValueError, match="at least one"):
        render_nginx([])


def test_every_replica_is_pinned_and_only_ring_members_hash() -> None:
    text = render_nginx([Replica("a", "h", 1), Replica("b", "h", 2), Replica("c", "h", 3)], ring=["a", "b"])
    for name, port in (("a", 1), ("b", 2), ("c", 3)):
        assert f"        {name} session_{name};\n" in text
        assert f"upstream session_{name} {{\n        server h:{port};" in text
    ring = text.split("upstream session_ring {", 1)[1].split("}", 1)[0]
    assert "server h:1 max_fails=0;" in ring and "server h:2 max_fails=0;" in ring and "h:3" not in ring


def test_nginx_accepts_the_generated_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        binary = nginx_binary()
    except FileNotFoundError:
        pytest.skip("nginx is not installed (make test installs it)")
    conf = tmp_path / "nginx.conf"
    args = ["--replica", "r0=127.0.0.1:8001", "--replica", "r1=127.0.0.1:8002", "--runtime-dir", str(tmp_path)]
    assert main([*args, "-o", str(conf)]) == 0
    assert main(args) == 0
    assert capsys.readouterr().out == conf.read_text()
    check = subprocess.run([binary, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf)],
                           capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr


def test_prometheus_scrapes_each_replica_directly_under_its_name() -> None:
    doc = json.loads(scrape_config([Replica("r0", "10.0.0.1", 8000), Replica("r1", "10.0.0.2", 8000)]))
    (job,) = doc["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["10.0.0.1:8000"], "labels": {"replica": "r0"}},
                                     {"targets": ["10.0.0.2:8000"], "labels": {"replica": "r1"}}]
    with pytest.raises(ValueError, match="given twice"):
        scrape_config([Replica("r0", "h", 1), Replica("r0", "h", 2)])


def test_admin_reads_the_live_state_from_a_real_exposition() -> None:
    from session_server.metrics import Metrics

    metrics = Metrics()
    metrics.watch("sessions", "live sessions", lambda: 7)
    metrics.watch("paused", "paused", lambda: 1)
    metrics.sessions_created.inc(3)
    for route, status, n in (("/sessions/{session_id}/v1/chat/completions", 200, 4), ("/v1/chat/completions", 200, 2),
                             ("/sessions/{session_id}/v1/chat/completions", 503, 5), ("/sessions", 200, 9),
                             ("/sessions/{session_id}/v1/chat/completions", 409, 1), ("/sessions", 500, 1)):
        for _ in range(n):
            metrics.response(route, "POST", status)
    values = metric_values(metrics.render().decode())
    assert values["sessions"] == 7 and values["paused"] == 1 and values["sessions_created_total"] == 3
    assert values["chats"] == 6 and values["errors"] == 6
