# Two commands on a fresh machine: `make demo` and `make test`. Both install into ./.venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TOKENIZERS := .cache/tokenizers

.PHONY: demo test lint bench bench-overhead tokenizers clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[rollout,tokenizers,bench,dev]"
	touch $(STAMP)

$(TOKENIZERS)/.built: $(STAMP) scripts/build_tokenizers.py
	$(PY) scripts/build_tokenizers.py --out $(TOKENIZERS)
	touch $@

tokenizers: $(TOKENIZERS)/.built

demo: $(STAMP) $(TOKENIZERS)/.built
	$(PY) scripts/demo.py --tokenizers $(TOKENIZERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) $(TOKENIZERS)/.built
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench: $(STAMP) $(TOKENIZERS)/.built
	$(PY) bench_session_responsiveness.py --tokenizer $(TOKENIZERS)/qwen3

bench-overhead: $(STAMP) $(TOKENIZERS)/.built
	$(PY) scripts/bench_turn_overhead.py --tokenizer $(TOKENIZERS)/qwen3

clean:
	rm -rf $(VENV) .cache out
