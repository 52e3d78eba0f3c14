"""The benchmarks: timing goals live here, never in tests. Run one as `python -m benchmarks.NAME` from the repository
root; what they share (the pinned engine + server pair, /proc readers, the JSON report, the health poller) is in
benchlib, and the floor they measure the server against is floor_proxy. bench_session_responsiveness.py, the
design's responsiveness benchmark, stays at the top level and imports benchlib too."""
