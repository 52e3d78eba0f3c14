"""Launch `sglang-sim` and `session-server` as child processes on loopback (the demo, the tests, the benchmarks).

Both programs accept `--port 0` and print `<prog> ready on http://HOST:PORT` once they accept connections, so a
child is started on a port the OS picks (no free-port race), its URL is read from that line, and it is ready when
`GET /health` answers 200 as well. Each child runs with this interpreter (the venv's packages, whether or not its
console scripts are on PATH), in its own process group (a Ctrl-C in the terminal reaches the parent, which stops
the children in order), and its output is drained on a thread (a pipe nobody reads would block a chatty child),
kept for error messages and optionally written to a log file. `stop()` sends SIGTERM, waits for the graceful
shutdown and kills only if it hangs; `close()` also fails loudly if the child had crashed while serving.

For the benchmarks, a child can be pinned to a set of cores (`cpus`, set in the child before exec, like `taskset`)
and run with source trees first on its PYTHONPATH (`python_path`, e.g. a patched copy of the server to measure
against the installed code).

`start_router` launches the real `sglang-router` (its Python launcher, a Rust server) in front of sims: it cannot take
`--port 0`, so it gets a port that was free a moment ago, and it is ready once it reports every worker registered.

`start_sglang` launches the real SGLang (`python -m sglang.launch_server`) with another interpreter (its own venv) and
the flags that serve a model on a CPU; it is ready once its cheap `GET /ready` answers (30-40 s for a tiny model).

`start_smg` launches the real `smg` gateway (sglang-router's successor) like `start_router`; it is ready once
`GET /workers` lists every worker.

`start_nginx` runs the system's nginx (the Debian package) in the foreground on a config from `deploy.nginx`, logging to
its output; `reload_nginx` sends it SIGHUP and waits until the new workers run.

The demos, the tests (tests/support/stack.py), the benchmarks and the soaks all launch through this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, TypedDict, Unpack

import httpx

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
SIM_READY = re.compile(r"sglang-sim ready on (http://\S+)")
SERVER_READY = re.compile(r"session-server ready on (http://\S+)")


def _prepare_child(cpus: frozenset[int] | None) -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the parent dies (a killed test run leaves no orphans),
    and pin it to `cpus` if given."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


class ProcessCrashed(RuntimeError):
    """The child exited when it should have been serving (the message carries its output tail)."""


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free a moment ago (prefer `--port 0` plus a ready line when the program supports it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RunningProcess:
    """A started child process serving HTTP at `url` (ready on return unless `wait=False`: then `wait_ready()`).

    `cpus`: the cores the child may run on (default: this process's). `python_path`: directories put first on the
    child's PYTHONPATH. `startup_timeout` only turns a hang into a failure: a start takes a second or two on a quiet
    machine and tens of seconds on a loaded one (a tokenizer load beside an engine's), so the default is generous."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        ready_pattern: re.Pattern[str] | None = None,
        url: str | None = None,
        health_path: str | None = "/health",
        env: dict[str, str] | None = None,
        startup_timeout: float = 300.0,
        name: str | None = None,
        log_path: Path | None = None,
        log_dir: Path | None = None,
        wait: bool = True,
        cpus: Iterable[int] | None = None,
        python_path: Sequence[str | Path] = (),
    ) -> None:
        if ready_pattern is None and url is None:
            raise ValueError("need a ready_pattern that captures the URL, or a known url to poll")
        self.cmd = [str(c) for c in cmd]
        self.name = name or Path(self.cmd[0]).name
        self.url = url or ""
        self.output: list[str] = []
        if log_path is None and log_dir is not None:
            log_path = Path(log_dir) / (re.sub(r"[^\w.-]+", "-", self.name).strip("-") + ".log")
        self.log_path = log_path
        self.killed = False  # True when stop() had to SIGKILL it
        self._ready_pattern = ready_pattern
        self._health_path = health_path
        self._startup_timeout = startup_timeout
        self._ready = threading.Event()
        self._closed = False
        self._log: IO[str] | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "w")  # noqa: SIM115 - closed by the drain thread at EOF
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if python_path:
            paths = [str(Path(d).resolve()) for d in python_path]
            full_env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [full_env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=full_env,
            start_new_session=True,
            preexec_fn=functools.partial(_prepare_child, None if cpus is None else frozenset(cpus)),
        )
        self._reader = threading.Thread(target=self._drain, name=f"{self.name}-output", daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(httpx.URL(self.url).port or 80)

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                line = line.rstrip("\n")
                self.output.append(line)
                if self._log is not None:
                    self._log.write(line + "\n")
                    self._log.flush()
                if self._ready_pattern is not None and not self._ready.is_set():
                    m = self._ready_pattern.search(line)
                    if m:
                        self.url = m.group(1)
                        self._ready.set()
        finally:
            if self._log is not None:
                self._log.close()

    def tail(self, n: int = 40) -> str:
        """The last `n` lines the child printed."""
        return "\n".join(self.output[-n:])

    log_tail = tail

    def wait_ready(self) -> RunningProcess:
        """Block until the ready line (if any) and `GET {url}{health_path}` -> 200; a failed child is stopped."""
        try:
            self._wait_ready(self._startup_timeout, self._health_path)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float, health_path: str | None) -> None:
        deadline = time.monotonic() + timeout
        if self._ready_pattern is not None:
            while not self._ready.wait(0.05):
                self.check_alive(" before it was ready")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.tail()}")
        if health_path is None:
            return
        while True:
            self.check_alive()
            try:
                if httpx.get(self.url + health_path, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} health check never passed:\n{self.tail()}")
            time.sleep(0.05)

    def check_alive(self, when: str = "") -> None:
        """ProcessCrashed, with the child's last output, if it has exited while it should be starting or serving."""
        if self.proc.poll() is not None:
            self._reader.join(2)  # the output up to the exit
            raise ProcessCrashed(f"{self.name} exited with {self.proc.returncode}{when}:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait up to `timeout` s for the graceful shutdown, else SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                self.killed = True
        self._reader.join(5)
        return int(self.proc.returncode)

    def close(self) -> None:
        """Stop the child; raises ProcessCrashed if it had died on its own or exited uncleanly."""
        if self._closed:
            return
        self._closed = True
        crashed_before = self.proc.poll() is not None
        code = self.stop()
        if crashed_before:
            raise ProcessCrashed(f"{self.name} died while serving (exit {code}):\n{self.tail()}")
        if self.killed or code != 0:  # both programs exit 0 after a graceful SIGTERM
            raise ProcessCrashed(f"{self.name} exited with {code} on SIGTERM:\n{self.tail()}")

    def __enter__(self) -> RunningProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LaunchOptions(TypedDict, total=False):
    """The keyword options of `start_sim` / `start_session_server`, passed on to `RunningProcess`."""

    env: dict[str, str] | None
    startup_timeout: float
    log_path: Path | None
    log_dir: Path | None
    wait: bool
    cpus: Iterable[int] | None
    python_path: Sequence[str | Path]


def _start_module(
    module: str, args: Sequence[str], ready_pattern: re.Pattern[str], name: str, health_path: str = "/health",
    **options: Unpack[LaunchOptions],
) -> RunningProcess:
    """`python -m module args` on a loopback port the OS picks (its `--port 0` ready line names the port)."""
    argv = [str(a) for a in args]
    if "--port" not in argv:
        argv += ["--port", "0"]
    if "--host" not in argv:
        argv += ["--host", LOOPBACK]
    # `-m` puts the working directory first on sys.path, ahead of PYTHONPATH: `-P` keeps `python_path` first.
    flags = ["-P"] if options.get("python_path") else []
    cmd = [sys.executable, *flags, "-m", module, *argv]
    return RunningProcess(cmd, ready_pattern=ready_pattern, name=name, health_path=health_path, **options)


def start_sim(
    tokenizer_dir: str | Path, family: str, *extra_args: str, **options: Unpack[LaunchOptions]
) -> RunningProcess:
    """`sglang-sim` on a loopback port the OS picks, ready when its cheap `GET /ready` answers (its `/health`, like
    SGLang's, runs a generation and takes a second)."""
    args = ["--tokenizer", str(tokenizer_dir), "--model-family", family, *extra_args]
    return _start_module("sglang_sim.cli", args, SIM_READY, f"sglang-sim[{family}]", health_path="/ready",
                         **options)


def start_session_server(
    engine_url: str,
    tokenizer_dir: str | Path,
    family: str,
    *extra_args: str,
    name: str = "session-server",
    **options: Unpack[LaunchOptions],
) -> RunningProcess:
    """`session-server` in front of `engine_url`, on a loopback port the OS picks."""
    args = ["--engine-url", engine_url, "--tokenizer", str(tokenizer_dir), "--model-family", family, *extra_args]
    return _start_module("session_server.cli", args, SERVER_READY, name, **options)


def start_router(
    worker_urls: Sequence[str], *extra_args: str, policy: str = "manual", **options: Unpack[LaunchOptions]
) -> RunningProcess:
    """The real `sglang-router` (`python -m sglang_router.launch_router`) in front of `worker_urls`, on loopback.

    The router registers each worker's tokenizer from the `model_path` the worker reports, so sims behind it must
    be started with `--model-path <tokenizer dir>`. Ready when `/get_server_info` counts every worker."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn", *extra_args,
    ]
    wait = options.pop("wait", True)
    proc = RunningProcess(cmd, url=f"http://{LOOPBACK}:{port}", name="sglang-router", wait=False, **options)
    if wait:
        wait_router(proc, len(worker_urls), options.get("startup_timeout", 300.0))
    return proc


def wait_router(proc: RunningProcess, workers: int, timeout: float = 300.0, *, path: str = "/get_server_info",
                count_key: str = "workers_count") -> RunningProcess:
    """Block until the router answers and its `GET path` counts `workers` workers under `count_key`; a failed router
    is stopped."""
    deadline = time.monotonic() + timeout
    try:
        proc.wait_ready()
        while True:
            try:
                info = httpx.get(proc.url + path, timeout=2.0).json()
                if info.get(count_key) == workers:
                    return proc
            except (httpx.TransportError, ValueError):
                pass
            proc.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} did not register {workers} workers in {timeout}s:\n{proc.tail()}")
            time.sleep(0.1)
    except BaseException:
        proc.stop()
        raise


def start_smg(
    worker_urls: Sequence[str], *extra_args: str, policy: str = "manual", **options: Unpack[LaunchOptions]
) -> RunningProcess:
    """The real `smg` gateway (PyPI `smg`, the successor of sglang-router: `python -m smg launch`) in front of
    `worker_urls`, on loopback.

    Its metrics exporter would bind 0.0.0.0:29000: it gets a free loopback port instead. Its `/health` answers 200
    before any worker is registered (a worker is registered once its own `/health` passes), so it is ready when
    `GET /workers` lists every worker. Sims behind it should report a `--model-path` (smg reads the model id)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "smg", "launch", "--host", LOOPBACK, "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
        "--prometheus-host", LOOPBACK, "--prometheus-port", str(free_port()), *extra_args,
    ]
    wait = options.pop("wait", True)
    proc = RunningProcess(cmd, url=f"http://{LOOPBACK}:{port}", name="smg", wait=False, **options)
    if wait:
        wait_router(proc, len(worker_urls), options.get("startup_timeout", 300.0), path="/workers", count_key="total")
    return proc


# The flags that serve a model with released SGLang 0.5.23 on a CPU (docs/design.md 5.5): its pure-PyTorch paths
# (`SGLANG_USE_CPU_ENGINE` unset: the official CPU engine needs a CPU build of sgl_kernel that PyPI lacks), no CUDA
# graphs, no warm-up request, a small KV pool, the streaming sessions the session server's --engine-sessions uses, and
# a scheduler that sleeps when idle (it busy-polls by default: a whole core per idle engine).
SGLANG_CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    "--skip-server-warmup", "--max-total-tokens", "8192", "--max-running-requests", "8",
    "--chunked-prefill-size", "2048", "--enable-streaming-session", "--sleep-on-idle",
)


class EngineProcess(RunningProcess):
    """A real SGLang server. Its launcher starts a scheduler and a detokenizer process in its own process group (the
    launcher's PID is the group's id): `stop()` ends the launcher gracefully and then whatever of the group is left,
    and `kill()` SIGKILLs the whole group at once, as an OOM kill or a node failure would."""

    def stop(self, timeout: float = 30.0) -> int:
        code = super().stop(timeout)
        self._signal_group(signal.SIGKILL)
        return code

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        self.proc.wait(10)
        self._reader.join(5)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)


# SGLang's CPU path imports a CUDA-only op at load time: the real-engine tier's plugin supplies a pure-torch one,
# registered through SGLang's own `sglang.srt.plugins` entry point (its directory goes on the engine's PYTHONPATH:
# `plugin_dir`). The demo launches its engine with it too.
SGLANG_CPU_PLUGIN = Path(__file__).resolve().parent.parent / "tests" / "sglang" / "plugin"


def start_sglang(
    python: str | Path, model_path: str | Path, *extra_args: str, plugin_dir: str | Path | None = None,
    cpu: bool = True, port: int | None = None, name: str = "sglang", **options: Unpack[LaunchOptions],
) -> EngineProcess:
    """Real SGLang serving `model_path` on loopback, run by `python` (an interpreter with sglang installed).

    `cpu`: add SGLANG_CPU_FLAGS. `plugin_dir`: a directory put first on the engine's PYTHONPATH whose
    `*.dist-info/entry_points.txt` registers `sglang.srt.plugins` (SGLang loads them in each of its processes).
    Nothing is read from a model hub (HF_HUB_OFFLINE). SGLang cannot take `--port 0`: by default the port is one that
    was free a moment ago (give `port` to restart an engine where its clients expect it)."""
    port = port or free_port()
    cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", LOOPBACK,
           "--port", str(port), *(SGLANG_CPU_FLAGS if cpu else ()), *extra_args]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(options.pop("env", None) or {})}
    python_path = [*options.pop("python_path", ()), *([plugin_dir] if plugin_dir is not None else [])]
    options.setdefault("startup_timeout", 300.0)
    return EngineProcess(cmd, url=f"http://{LOOPBACK}:{port}", health_path="/ready", name=name, env=env,
                         python_path=python_path, **options)


NGINX_PATHS = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


def nginx_binary() -> str:
    """The nginx executable (PATH first, then where Debian and source builds put it); FileNotFoundError says how to
    get one."""
    found = shutil.which("nginx") or next((p for p in NGINX_PATHS if os.access(p, os.X_OK)), None)
    if found is None:
        raise FileNotFoundError("nginx is not installed: apt-get install -y nginx-light (or nginx)")
    return found


def start_nginx(config: Path, port: int, **options: Unpack[LaunchOptions]) -> RunningProcess:
    """nginx with `config` (listening on loopback `port`), in the foreground, its error log on its output; ready when
    `GET /health` passes through it. Run as root, its workers stay root (they use the config's runtime directory,
    which only root may enter)."""
    globals_ = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
    cmd = [nginx_binary(), "-e", "stderr", "-p", str(config.parent), "-c", str(config), "-g", globals_]
    return RunningProcess(cmd, url=f"http://{LOOPBACK}:{port}", name="nginx", **options)


def reload_nginx(proc: RunningProcess, timeout: float = 30.0) -> None:
    """SIGHUP: nginx re-reads its config, starts new workers and lets the old ones finish their requests. Returns
    once the master has started the new workers (needs `error_log ... notice`); a config nginx refused raises."""
    seen = len(proc.output)
    proc.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while True:
        proc.check_alive(" during a reload")
        lines = proc.output[seen:]
        refused = [line for line in lines if "[emerg]" in line or "[alert]" in line]
        if refused:
            raise RuntimeError(f"nginx refused the new config:\n{chr(10).join(refused)}")
        if any("reconfiguring" in line for line in lines) and any("start worker process" in line for line in lines):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nginx did not reload in {timeout}s:\n{proc.tail()}")
        time.sleep(0.02)
