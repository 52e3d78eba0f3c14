"""The loopback test harness: the process launchers (the sim, the server, routers, smg, real SGLang, nginx), N
replicas behind nginx, and the sim's scripted tasks, for the demos, the tests, the benchmarks and the soaks.

It stands beside `rollout/` rather than in it: a trainer installs `rollout` for its session client and gets no
launchers, and `rollout` imports `trajectory` only (tests/unit/test_architecture.py). Exports nothing: import the
module you need (`harness.launchers`, `harness.nginx_cluster`, `harness.scripted_tasks`)."""
