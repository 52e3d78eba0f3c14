"""N `session-server` replicas behind the real nginx on loopback: the cluster demo, its e2e test and the 1-vs-N
benchmark start it here.

Each replica gets a fixed port and its own journal, so it can be killed and restarted on both, as a replica in a
deployment is; nginx runs on a config from `deploy.nginx`, rewritten and reloaded when replicas join
(`add_replica`).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy.nginx import render_nginx
from deploy.replicas import Replica
from harness.launchers import LOOPBACK, RunningProcess, free_port, reload_nginx, start_nginx, start_session_server


@dataclass
class LocalCluster:
    """Replicas named `r0`, `r1`, ... in front of `engine_urls` (each replica gets every `--engine-url`) and nginx.

    `server_args` go to every replica; `ring`: the replica names that place client-chosen ids (default: those
    started by `start`, fixed afterwards, so adding a replica moves no live session)."""

    engine_urls: Sequence[str]
    tokenizer: Path
    family: str
    workdir: Path
    server_args: Sequence[str] = ()
    journal: bool = True
    replicas: dict[str, Replica] = field(default_factory=dict)
    procs: dict[str, RunningProcess] = field(default_factory=dict)
    nginx: RunningProcess | None = None
    ring: list[str] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        """The load balancer's base URL: what agents and the trainer use."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "nginx.conf"

    def journal_path(self, name: str) -> Path:
        return self.workdir / f"{name}.journal.sqlite"

    def start(self, replicas: int) -> LocalCluster:
        """Start `replicas` replicas at once, then nginx in front of them."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        names = [f"r{i}" for i in range(replicas)]
        for name in names:
            self.replicas[name] = Replica(name, LOOPBACK, free_port())
        pending = [self._launch(name, wait=False) for name in names]
        try:
            for proc in pending:
                proc.wait_ready()
        except BaseException:
            self.close()
            raise
        self.ring = list(names)
        self.port = free_port()
        self._write_config()
        self.nginx = start_nginx(self.config_path, self.port, log_dir=self.workdir)
        return self

    def _launch(self, name: str, wait: bool = True) -> RunningProcess:
        replica = self.replicas[name]
        engines = [flag for url in self.engine_urls[1:] for flag in ("--engine-url", url)]
        args = [*engines, "--replica-name", name, "--port", str(replica.port), *self.server_args]
        if self.journal:
            args += ["--journal", str(self.journal_path(name))]
        proc = start_session_server(self.engine_urls[0], self.tokenizer, self.family, *args, name=name,
                                    log_path=self.workdir / f"{name}.log", wait=wait)
        self.procs[name] = proc
        return proc

    def _write_config(self) -> None:
        self.config_path.write_text(render_nginx(
            list(self.replicas.values()), listen=f"{LOOPBACK}:{self.port}", ring=self.ring, workers="1",
            runtime_dir=self.workdir, log_level="notice",
        ))

    def replica_url(self, name: str) -> str:
        return self.replicas[name].url

    def kill(self, name: str) -> None:
        """SIGKILL a replica (no graceful shutdown: what an OOM kill or a lost node does)."""
        proc = self.procs[name]
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(10)

    def restart(self, name: str) -> RunningProcess:
        """Start a stopped or killed replica again on its port and journal."""
        self.procs[name].stop()
        return self._launch(name)

    def add_replica(self) -> str:
        """Start one more replica, put it in nginx's config (not in the ring) and reload nginx; returns its name."""
        name = f"r{len(self.replicas)}"
        self.replicas[name] = Replica(name, LOOPBACK, free_port())
        self._launch(name)
        self._write_config()
        self.reload()
        return name

    def reload(self) -> None:
        assert self.nginx is not None
        reload_nginx(self.nginx)

    def close(self) -> list[str]:
        """Stop nginx, then every replica; returns what exited uncleanly (each replica must exit 0 on SIGTERM)."""
        failures = []
        for proc in [*([self.nginx] if self.nginx is not None else []), *reversed(list(self.procs.values()))]:
            code = proc.stop()
            if code != 0:
                failures.append(f"{proc.name} exited with {code} on SIGTERM:\n{proc.tail()}")
        return failures
