# Every target bootstraps .venv itself: a fresh machine needs only python3.11 and make.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: venv test serve bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[service,dev,plot]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -c "import moegrad; moegrad.warm_up()"  # compile the kernel once; test servers then load it
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/moegrad-service serve --host $(HOST) --port $(PORT) --backend reference

bench: $(STAMP)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist .pytest_cache
