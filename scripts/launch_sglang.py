"""Launch a real SGLang server with the flags the session server relies on, and print the matching server command.

Needs a GPU machine with sglang installed (`pip install '.[sglang]'`). The flags that matter to the session server:

- `--enable-streaming-session`: lets `session-server --engine-sessions` keep each trajectory's KV in an engine
  session, so a turn prefills only its new tokens (docs/design.md 5.2). Harmless without `--engine-sessions`.
- `--enable-return-routed-experts` (with `--routed-experts`): MoE routing replay; the session server keeps the
  payload in its records and never sends it to agents.
- `--api-key` / `--admin-api-key` (with `--keys`): the engine wants `Authorization: Bearer` on every call; the
  session server sends the api key on /generate and sessions and the admin key on abort/pause (SGLang's auth
  levels). The keys are read from the environment of both processes and never printed: set ENGINE_API_KEY and
  ENGINE_ADMIN_API_KEY before running the printed commands.
- `--reasoning-parser` (the model family's, for a family that reasons): a forced tool call or a JSON answer in thinking
  mode is sent with `require_reasoning`, and only an engine with a reasoning parser then lets the model think first.
- the tokenizer stays enabled (no `--skip-tokenizer-init`): the session server sends `input_ids` either way, but
  reads the reply `text` and relies on the engine for `stop` strings.

    python scripts/launch_sglang.py --model-path /models/Qwen3-8B --port 30000
    python scripts/launch_sglang.py --model-path /models/Qwen3-8B --dry-run -- --tp 2   # print the commands only

Arguments after `--` are passed to `sglang.launch_server` unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

from trajectory.families import family_class


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="model directory or hub id, as for sglang.launch_server")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the engine (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="engine port (default 30000)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (SGLang's default: 1)")
    p.add_argument("--context-length", type=int, default=None, help="override the model's context length")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="GPU memory fraction for weights + KV")
    p.add_argument("--routed-experts", action="store_true", help="return MoE routed experts (routing replay)")
    p.add_argument("--keys", action="store_true",
                   help="protect the engine with --api-key/--admin-api-key from $ENGINE_API_KEY/$ENGINE_ADMIN_API_KEY")
    p.add_argument("--model-family", default="qwen3", help="session-server model family (default qwen3)")
    p.add_argument("--session-port", type=int, default=8000, help="port in the printed session-server command")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit (works without sglang)")
    return p.parse_args(argv), extra


def sglang_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path]
    cmd += ["--host", args.host, "--port", str(args.port), "--enable-streaming-session"]
    if args.tp is not None:
        cmd += ["--tp", str(args.tp)]
    if args.context_length is not None:
        cmd += ["--context-length", str(args.context_length)]
    if args.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(args.mem_fraction_static)]
    if args.routed_experts:
        cmd.append("--enable-return-routed-experts")
    parser = family_class(args.model_family).sglang_reasoning_parser
    if parser is not None:
        cmd += ["--reasoning-parser", parser]
    if args.keys:  # expanded by the shell that runs the printed command (or by main() below): never printed
        cmd += ["--api-key", "$ENGINE_API_KEY", "--admin-api-key", "$ENGINE_ADMIN_API_KEY"]
    return cmd + extra


def session_server_command(args: argparse.Namespace) -> list[str]:
    env = (["SESSION_SERVER_ENGINE_API_KEY=$ENGINE_API_KEY",
            "SESSION_SERVER_ENGINE_ADMIN_API_KEY=$ENGINE_ADMIN_API_KEY"] if args.keys else [])
    return env + [
        "session-server",
        "--engine-url", f"http://{args.host}:{args.port}",
        "--tokenizer", args.model_path,
        "--model-family", args.model_family,
        "--port", str(args.session_port),
        "--engine-sessions",
    ] + (["--return-routed-experts"] if args.routed_experts else [])  # fmt: skip


def _shell(cmd: list[str]) -> str:
    """Quote for a POSIX shell but leave `$VAR` references for the shell to expand (keys stay out of the text)."""
    return " ".join(f'"{c}"' if "$" in c and "=" not in c else
                    (c.split("=", 1)[0] + '="' + c.split("=", 1)[1] + '"' if "$" in c else shlex.quote(c))
                    for c in cmd)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    cmd = sglang_command(args, extra)
    print("engine:         " + _shell(cmd))
    print("session server: " + _shell(session_server_command(args)))
    print(f"demo:           python -m examples.demo --engine-url http://{args.host}:{args.port} "
          f"--tokenizer {shlex.quote(args.model_path)} --model-family {args.model_family}")
    if args.dry_run:
        return 0
    if importlib.util.find_spec("sglang") is None:
        print(
            "error: sglang is not installed in this environment; on a GPU machine run `pip install '.[sglang]'` "
            "(or use the emulated engine: `sglang-sim`, `make demo`)",
            file=sys.stderr,
        )
        return 2
    if args.keys:
        missing = [k for k in ("ENGINE_API_KEY", "ENGINE_ADMIN_API_KEY") if not os.environ.get(k)]
        if missing:
            print(f"error: --keys needs {' and '.join(missing)} in the environment", file=sys.stderr)
            return 2
        cmd = [os.path.expandvars(c) for c in cmd]
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # the engine replaces this process: signals and exit code are its own


if __name__ == "__main__":
    sys.exit(main())
