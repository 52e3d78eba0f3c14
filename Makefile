# Three commands on a fresh machine: `make demo` and `make test` (both install into ./.venv first), and `make test-sglang`
# (the real-engine tier: released SGLang 0.5.23 on CPU, in its own ./.venv-sglang).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TOKENIZERS := .cache/tokenizers

.PHONY: demo test test-sglang test-fast lint browser harnesses bench bench-overhead bench-stream bench-scale bench-burst bench-compare soak soak-crash tokenizers clean nginx demo-cluster demo-rl demo-gui test-trainers

$(STAMP): pyproject.toml requirements-lock.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "pip==26.3"
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[rollout,tokenizers,bench,dev,real,trace]" \
		--config-settings editable_mode=compat
	$(PY) -m pip install -q --no-deps "sglang==0.5.23"
	touch $(STAMP)

$(TOKENIZERS)/.built: $(STAMP) scripts/build_tokenizers.py $(wildcard trajectory/families/templates/*.jinja)
	$(PY) -m scripts.build_tokenizers --out $(TOKENIZERS)
	touch $@

tokenizers: $(TOKENIZERS)/.built

# The real load balancer of the scale-out tests and demo (deploy/): Debian's nginx, installed when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive sh -c "apt-get install -y -q nginx-light || { apt-get update -q && apt-get install -y -q nginx-light; }"

# The browser the viewer's tests drive headless with selenium (tests/e2e/test_viewer_browser.py, docs/viewer.md):
# Debian's chromium and its chromedriver, installed when missing.
browser:
	@command -v chromedriver >/dev/null && command -v chromium >/dev/null || \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive sh -c "apt-get install -y -q chromium chromium-driver || { apt-get update -q && apt-get install -y -q chromium chromium-driver; }"

# The real coding harnesses tests/e2e/test_harnesses.py runs (their npm packages carry their native binaries).
HARNESSES := .cache/harnesses
$(HARNESSES)/.installed:
	mkdir -p $(HARNESSES)
	npm install --no-audit --no-fund --prefix $(HARNESSES) @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.328
	touch $@

harnesses: $(HARNESSES)/.installed

# Extra flags: make demo DEMO_ARGS="--journal out/journal.sqlite" (the server keeps a SQLite journal; docs/operating.md).
DEMO_ARGS ?=
demo: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m examples.demo --tokenizers $(TOKENIZERS) $(DEMO_ARGS)

# The demo through nginx in front of 3 session-server replicas over 2 emulated engines (deploy/, examples/demo_cluster.py);
# prints per-replica sessions and chats. Extra flags: make demo-cluster CLUSTER_ARGS="--replicas 2 --episodes 128".
CLUSTER_ARGS ?=
demo-cluster: $(STAMP) $(TOKENIZERS)/.built nginx
	$(PY) -m examples.demo_cluster --tokenizers $(TOKENIZERS) $(CLUSTER_ARGS)

# GUI-agent episodes (examples/gui_agent/, docs/gui-agent.md): screenshots of a toy desktop through the server with the
# openai and anthropic SDKs; prints each episode's reward and each sample's image spans. Extra flags:
# make demo-gui GUI_ARGS="--episodes 32 --api chat".
GUI_ARGS ?=
demo-gui: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m examples.gui_agent --tokenizers $(TOKENIZERS) $(GUI_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The whole suite: lint, then every tier (tests/unit: pure, in-process; tests/e2e: real processes over loopback), on
# TEST_WORKERS pytest-xdist workers (tests/conftest.py: a module's tests share one worker and its process stack).
# More workers than cores pays: e2e tests spend much of their time waiting on their processes.
TEST_WORKERS ?= 3
test: $(STAMP) $(TOKENIZERS)/.built nginx browser $(HARNESSES)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25

# The real-engine tier (tests/sglang, docs/design.md 5.5): released SGLang 0.5.23 serving tiny random Qwen3 / Qwen3-MoE
# checkpoints on the CPU. SGLang runs from its own venv (~6.5 GB, every package pinned in tests/sglang/engine-lock.txt,
# installed once: the stamp is rebuilt only when the lock changes), the suite and the session server from ./.venv.
# `make test` never installs it. The engines are shared across the tier's modules: a handful of launches in all.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
CHECKPOINTS := .cache/checkpoints

$(SGLANG_STAMP): tests/sglang/engine-lock.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -r tests/sglang/engine-lock.txt
	touch $(SGLANG_STAMP)

$(CHECKPOINTS)/.built: $(SGLANG_STAMP) $(TOKENIZERS)/.built scripts/build_tiny_checkpoints.py trajectory/image_grid.py
	$(SGLANG_VENV)/bin/python -m scripts.build_tiny_checkpoints --tokenizer $(TOKENIZERS)/qwen3 --out $(CHECKPOINTS)
	$(SGLANG_VENV)/bin/python -m scripts.build_tiny_adapters --base $(CHECKPOINTS)/qwen3-dense --out $(CHECKPOINTS)/lora-qwen3-dense
	touch $@

test-sglang: $(STAMP) $(CHECKPOINTS)/.built
	$(PY) -m pytest -q -p no:xdist --durations=25 tests/sglang --sglang-venv $(SGLANG_VENV) --checkpoints $(CHECKPOINTS)

# A real GRPO loop on the CPU (examples/demo_rl/): released SGLang 0.5.23 from its venv serving the tiny Qwen3, a
# policy warmed up in the run, G episodes per prompt through the session server, the trainer's check, advantages and
# clipped step every step, weights pushed in place while the next episodes run; a table and out/demo-rl/demo_rl.png.
# Extra flags: make demo-rl RL_ARGS="--steps 30".
RL_ARGS ?=
demo-rl: $(STAMP) $(CHECKPOINTS)/.built
	$(PY) -m examples.demo_rl --sglang-venv $(SGLANG_VENV) --checkpoints $(CHECKPOINTS) $(RL_ARGS)

# The trainer adapters' tier (tests/trainers): rollout/adapters/ against the trainers' released packages (verl 0.9.1,
# SkyRL 0.4.0, AReaL 1.0.4, TRL 1.16.0, NeMo Gym 0.7.0; slime and miles are not on PyPI), real sessions on sglang-sim.
# Its own venv (the project, then tests/trainers/requirements.txt with --no-deps: the trainers' full installs want
# CUDA or Python 3.12+), torch 2.13.0 from the local disk; installed once, rebuilt when a pin changes.
TRAINERS_VENV := .venv-trainers
TRAINERS_STAMP := $(TRAINERS_VENV)/.installed

$(TRAINERS_STAMP): pyproject.toml requirements-lock.txt tests/trainers/requirements.txt
	test -x $(TRAINERS_VENV)/bin/python || $(PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_VENV)/bin/python -m pip install -q "pip==26.3"
	$(TRAINERS_VENV)/bin/python -m pip install -q -c requirements-lock.txt -e ".[rollout,tokenizers,dev]" \
		--config-settings editable_mode=compat
	$(TRAINERS_VENV)/bin/python -m pip install -q --no-deps --ignore-requires-python -r tests/trainers/requirements.txt
	touch $(TRAINERS_STAMP)

test-trainers: $(TRAINERS_STAMP)
	TEST_TRAINERS=1 $(TRAINERS_VENV)/bin/python -m pytest -q -p no:xdist tests/trainers

# The pure tier only, in seconds: run it constantly. Two workers: most of its time is hypothesis examples (here a
# fraction of each property's count, tests/support/examples.py; `make test` runs them all), and binding the families
# (up to 14 s of CPU for all nine), each on one worker (tests/conftest.py deals their tests). Bytecode is cached even
# where the environment says not to (PYTHONDONTWRITEBYTECODE): else each process compiles the project and rewrites
# every test module again, 3-4 s of CPU per process. A fifth of each count keeps it under 40 s on 2 cores as the suite
# grows; each run draws fresh examples and replays any failure first, so running it often explores as much.
FAST_EXAMPLES_SCALE ?= 0.2
test-fast: $(STAMP) $(TOKENIZERS)/.built
	PYTHONDONTWRITEBYTECODE= TEST_EXAMPLES_SCALE=$(FAST_EXAMPLES_SCALE) $(PY) -m pytest -q -n 2 tests/unit

# Benchmarks (timing goals live here, never in tests). Extra flags: make bench BENCH_ARGS="--duration 20".
BENCH_OUT := out/bench
BENCH_ARGS ?=

bench: $(STAMP) $(TOKENIZERS)/.built
	$(PY) bench_session_responsiveness.py --tokenizer $(TOKENIZERS)/qwen3 \
		--json-out $(BENCH_OUT)/pooled.json --plot $(BENCH_OUT)/pooled.png $(BENCH_ARGS)

bench-overhead: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m benchmarks.bench_turn_overhead --tokenizer $(TOKENIZERS)/qwen3 --json-out $(BENCH_OUT)/overhead.json $(BENCH_ARGS)

# Streamed vs unstreamed server CPU per reply (1k/4k/16k/32k tokens, an engine configured for one event per token,
# cumulative and delta engine events; the server asks for its stream interval, engine/pacing.py), the floor beside.
bench-stream: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m benchmarks.bench_stream --tokenizer $(TOKENIZERS)/qwen3 --json-out $(BENCH_OUT)/stream.json $(BENCH_ARGS)

# One process at scale: 10k live sessions of 4k tokens; RSS, CPU per turn, /health p99 while 64 chat; the floor beside.
bench-scale: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m benchmarks.bench_scale --tokenizer $(TOKENIZERS)/qwen3 --json-out $(BENCH_OUT)/scale.json $(BENCH_ARGS)

# The GRPO burst (issue 43): 300 and 1,000 sessions open at once, one turn each (10 % of the clients vanish), then all
# deleted; with and without --engine-sessions: burst and cleanup time, DELETE p99, control-call timeouts, engine books.
bench-burst: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m benchmarks.bench_burst --tokenizer $(TOKENIZERS)/qwen3 --json-out $(BENCH_OUT)/burst.json $(BENCH_ARGS)

# What the CPU pool and the lean engine client buy: the same run with the engine-response decode on the event loop,
# and with httpx as the /generate client, each diffed against the default run.
bench-compare: bench
	$(PY) bench_session_responsiveness.py --tokenizer $(TOKENIZERS)/qwen3 --inline-decode \
		--json-out $(BENCH_OUT)/inline.json --plot $(BENCH_OUT)/inline.png $(BENCH_ARGS)
	$(PY) bench_session_responsiveness.py --compare $(BENCH_OUT)/inline.json $(BENCH_OUT)/pooled.json
	$(PY) bench_session_responsiveness.py --tokenizer $(TOKENIZERS)/qwen3 --server-arg=--engine-client=httpx \
		--json-out $(BENCH_OUT)/httpx.json --plot $(BENCH_OUT)/httpx.png $(BENCH_ARGS)
	$(PY) bench_session_responsiveness.py --compare $(BENCH_OUT)/httpx.json $(BENCH_OUT)/pooled.json

soak: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m soaks.soak $(SOAK_ARGS)

# The journal's crash soak: chats and DELETEs with SIGKILLs of the server at random points, restarts on the same
# journal, every received turn checked exactly. make soak-crash SOAK_ARGS="--chats 10000 --kills 20"
soak-crash: $(STAMP) $(TOKENIZERS)/.built
	$(PY) -m soaks.crash_soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .cache out
