# Every target bootstraps .venv itself: a fresh machine needs only python3.11 and make.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-service
# The tests' torch: exactly this pin, which pip takes from a local CPU wheel (a range pulls a CUDA build).
TORCH_TEST_PIN := torch==2.13.0
# `make serve HOST=... PORT=... BACKEND=...`: each becomes a flag only when given, so MOEGRAD_* apply otherwise.
HOST ?=
PORT ?=
BACKEND ?=

.PHONY: venv test serve bench clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[service,dev,plot]' '$(TORCH_TEST_PIN)'
	touch $(STAMP) $(SERVE_STAMP)

# Serving needs only the service extra, not the test toolchain.
$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[service]'
	touch $(SERVE_STAMP)

test: $(STAMP)
	$(BIN)/ruff check client service
	$(BIN)/ruff format --check client service
	$(BIN)/mypy
	$(BIN)/python -c "import moegrad, moegrad.accuracy; moegrad.warm_up(); moegrad.accuracy.warm_up_compare()"  # compile once; test servers load the cache
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

serve: $(SERVE_STAMP)
	$(BIN)/moegrad-service serve $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(if $(BACKEND),--backend $(BACKEND))

bench: $(STAMP)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist .pytest_cache
