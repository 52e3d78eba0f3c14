"""`sglang-sim` command line: load the tokenizer, build the engine, serve it with uvicorn.

The socket is bound before uvicorn starts so `--port 0` works, and the ready line names the real port:
launchers (harness/launchers.py) wait for `sglang-sim ready on http://HOST:PORT` instead of polling and guessing ports.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

import uvicorn

from sglang_sim.app import SimServer
from sglang_sim.engine import Engine, EngineConfig
from sglang_sim.faults import FaultInjector
from sglang_sim.lora import parse_lora_paths
from sglang_sim.routed_experts import layers_for_bytes
from trajectory import family_names
from trajectory.image_grid import QWEN3_VL, ImageGeometry

READY_PREFIX = "sglang-sim ready on "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang-sim", description="Emulated SGLang engine (native HTTP API).")
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory (AutoTokenizer).")
    p.add_argument("--model-family", required=True, metavar="NAME",
                   help=f"Model family, one of: {', '.join(family_names())}.")
    p.add_argument("--model-path", default=None, help="Model name reported by model_info (default: sim-<family>).")
    p.add_argument("--host", default="127.0.0.1", help="Interface to bind.")
    p.add_argument("--port", type=int, default=30000, help="Port to bind; 0 picks a free one (see the ready line).")
    p.add_argument("--kv-capacity-tokens", type=int, default=65536,
                   help="KV pool size in token slots (server_info max_total_num_tokens).")
    p.add_argument("--max-running-requests", type=int, default=4096,
                   help="Request rows: requests running at once, an open streaming session keeping one (as SGLang).")
    p.add_argument("--context-length", type=int, default=32768, help="Longest prompt + max_new_tokens accepted.")
    p.add_argument("--token-latency-ms", type=float, default=0.0, help="Emulated decode time per generated token.")
    p.add_argument("--prefill-latency-ms", type=float, default=0.0,
                   help="Emulated prefill time per 1000 uncached prompt tokens (cached prefixes are free).")
    p.add_argument("--seed", type=int, default=0, help="Engine seed; replies are a function of seed and prompt.")
    p.add_argument("--enable-streaming-session", action="store_true",
                   help="Allow open_session with streaming=true (session-aware KV slots).")
    p.add_argument("--routed-experts-layers", type=int, default=0,
                   help="Like SGLang's --enable-return-routed-experts for a model with this many layers: "
                        "return_routed_experts gets base64 int32 [tokens, layers, top_k] (0 = off).")
    p.add_argument("--routed-experts-top-k", type=int, default=8, help="Experts per token (num_experts_per_tok).")
    p.add_argument("--routed-experts-bytes", type=int, default=0,
                   help="Shortcut for benchmarks: enable routed experts with the layers that make a 1k-token "
                        "sequence's payload about this many bytes.")
    p.add_argument("--weight-version", default="default", help="weight_version reported in meta_info.")
    p.add_argument("--api-key", default=None,
                   help="Like SGLang's --api-key: required as 'Authorization: Bearer KEY' on every endpoint but "
                        "/health, /ready and /metrics (and the /sim test hooks).")
    p.add_argument("--admin-api-key", default=None,
                   help="Like SGLang's --admin-api-key: required (instead of --api-key) on abort, pause/continue, "
                        "flush and weight-version calls.")
    p.add_argument("--health-latency-ms", type=float, default=1000.0,
                   help="Time GET /health takes (real SGLang runs a one-token generation there: >= 1 s). "
                        "GET /ready is the cheap probe.")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="Stream deltas (text, output_ids, logprobs of new tokens only), as SGLang's flag of that name; "
                        "default: cumulative events.")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="Tokens per stream event, as SGLang's flag of that name (SGLang's default 1: one event per "
                        "token); a request's sampling_params.stream_interval overrides it. Default: one event per "
                        "emulated decode wake-up (cheap for tests).")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="As SGLang's flag: a request with require_reasoning has its grammar (a forced tool call, a "
                        "JSON answer) wait until the reasoning ends, so a scripted reasoning block comes first; "
                        "reported by /server_info and /model_info.")
    p.add_argument("--sampling-mask-max-tokens", type=int, default=4096,
                   help="As SGLang's flag: the largest top_k a request with return_sampling_mask may use.")
    p.add_argument("--enable-lora", action="store_true", help="Serve LoRA adapters (`lora_path` on /generate).")
    p.add_argument("--lora-paths", nargs="*", default=None, metavar="NAME=DIR",
                   help="Adapters loaded at start (with --enable-lora); the sim reads no files: the path names them.")
    p.add_argument("--max-loaded-loras", type=int, default=None,
                   help="Adapters loaded at once; a load past it evicts the least recently used.")
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="Reported in /server_info only.")
    p.add_argument("--log-level", default="warning", help="uvicorn log level.")
    return p


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """Prints the ready line once accepting; on shutdown aborts in-flight requests first.

    Aborting before uvicorn drains connections lets every running request answer (finish_reason abort) instead
    of being cancelled mid-handler when the graceful-shutdown timeout runs out.
    """

    ready_line = ""
    engine: Engine | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            print(self.ready_line, flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not calling super(): it records the signal and re-raises it after the graceful shutdown, so the
        # process would die of SIGTERM instead of exiting 0. A second Ctrl-C still forces the exit.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.engine is not None:
            self.engine.abort(None, abort_all=True)
        await super().shutdown(sockets=sockets)


def image_geometry(directory: Path) -> ImageGeometry:
    """The checkpoint's image processor settings (its preprocessor_config.json), else the published Qwen3-VL ones:
    how `image_data` is resized and expanded."""
    config = directory / "preprocessor_config.json"
    if not config.is_file():
        return QWEN3_VL
    return ImageGeometry.from_preprocessor_config(json.loads(config.read_text()))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # The fast-tokenizer class loads the same tokenizer.json/config as AutoTokenizer but without importing the
    # model stack (torch), which halves start-up; tests start several engines.
    from transformers import PreTrainedTokenizerFast

    from sglang_sim.family import EngineFamily

    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    family = EngineFamily.create(args.model_family, tokenizer, image_geometry(Path(args.tokenizer)))
    config = EngineConfig(kv_capacity_tokens=args.kv_capacity_tokens, context_length=args.context_length,
                          token_latency_ms=args.token_latency_ms, prefill_latency_ms=args.prefill_latency_ms,
                          seed=args.seed, max_running_requests=args.max_running_requests,
                          enable_streaming_session=args.enable_streaming_session,
                          weight_version=args.weight_version,
                          incremental_streaming_output=args.incremental_streaming_output,
                          stream_interval=args.stream_interval, reasoning_parser=args.reasoning_parser,
                          sampling_mask_max_tokens=args.sampling_mask_max_tokens,
                          enable_lora=args.enable_lora or bool(args.lora_paths),
                          lora_paths=tuple(parse_lora_paths(args.lora_paths).items()),
                          max_loaded_loras=args.max_loaded_loras, max_loras_per_batch=args.max_loras_per_batch)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    engine = Engine(config, family)
    server = SimServer(engine=engine, faults=FaultInjector(args.seed),
                       model_path=args.model_path or f"sim-{family.name}",
                       tokenizer_path=str(Path(args.tokenizer)), routed_experts_layers=(args.routed_experts_layers or
                                              (layers_for_bytes(args.routed_experts_bytes, args.routed_experts_top_k)
                                               if args.routed_experts_bytes > 0 else 0)),
                       routed_experts_top_k=args.routed_experts_top_k,
                       host=host, port=port, api_key=args.api_key, admin_api_key=args.admin_api_key,
                       health_latency_s=args.health_latency_ms / 1000.0)
    uv_config = uvicorn.Config(server.app(), loop="uvloop", http="httptools", log_level=args.log_level,
                               access_log=False, timeout_graceful_shutdown=2)
    uv = _Server(uv_config)
    uv.engine = engine
    shown = f"[{host}]" if ":" in host else host
    uv.ready_line = f"{READY_PREFIX}http://{shown}:{port}"
    uv.run(sockets=[sock])
    if not uv.started:
        sys.exit(1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
