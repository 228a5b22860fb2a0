# Every target bootstraps .venv itself: a fresh machine needs only python3.11 and make.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-service
# Every install takes its versions from the lock: the exact set `make test` last passed with (`make lock` renews it).
LOCK := requirements.lock
MSPROBE_LOCK := requirements-msprobe.lock
MSPROBE_DIR := $(VENV)/msprobe
# The tests' torch: exactly this pin, which pip takes from a local CPU wheel (a range pulls a CUDA build).
TORCH_TEST_PIN := torch==2.13.0
# `make serve HOST=... PORT=... BACKEND=...`: each becomes a flag only when given, so MOEGRAD_* apply otherwise.
HOST ?=
PORT ?=
BACKEND ?=

.PHONY: venv test test-all serve bench lock clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# pip byte-compiles what it installs (a minute of the install, for torch's thousands of files), and
# that is worth it: where PYTHONDONTWRITEBYTECODE is set (this machine, CI) nothing else ever writes
# .pyc files, and every test process and server would compile its imports from source each time.
$(STAMP): pyproject.toml $(LOCK) $(MSPROBE_LOCK) | $(BIN)/python
	$(BIN)/python -m pip install --quiet --constraint $(LOCK) -e '.[service,dev,plot]' '$(TORCH_TEST_PIN)'
	$(BIN)/python -m pip check
	rm -rf $(MSPROBE_DIR)
	$(BIN)/python -m pip install --quiet --no-deps --target $(MSPROBE_DIR) --requirement $(MSPROBE_LOCK)
	touch $(STAMP) $(SERVE_STAMP)

# Serving needs only the service extra, not the test toolchain (at the locked versions all the same).
$(SERVE_STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/python -m pip install --quiet --constraint $(LOCK) -e '.[service]'
	touch $(SERVE_STAMP)

# The lock: what pyproject.toml's ranges resolve to today, frozen from a fresh environment. Renew it on
# purpose (then run `make test`, whose contract tests fail loudly if an upgrade moved a private member).
lock: | $(BIN)/python
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet --upgrade pip
	.lock-venv/bin/python -m pip install --quiet -e '.[service,dev,plot,torch]' '$(TORCH_TEST_PIN)'
	{ echo "# The versions \`make test\` and CI install (pip --constraint). Renew with \`make lock\`; do not edit by hand."; \
	  .lock-venv/bin/python -m pip freeze --exclude-editable; } > $(LOCK)
	rm -rf .lock-venv

# The kernels compile (numba, into its disk cache, so that every test server loads them) while mypy
# runs: three processes on the cores. Then two pytest runs: everything not marked serial, three files
# at a time (pytest-xdist), then the serial tests (timing-sensitive: the attacks) alone.
# `make test` leaves out the tests marked slow; `make test-all` runs them too. compileall writes the
# project's own .pyc files once (PYTHONDONTWRITEBYTECODE keeps imports from writing them): a test
# server's imports then take about 1.4 s of CPU instead of 2.4 s.
PYTEST_LANES := -n 3 --dist loadfile

test: $(STAMP)
	$(BIN)/ruff check client service
	$(BIN)/ruff format --check client service
	$(BIN)/lint-imports
	$(BIN)/python -m compileall -q client service bench tests
	$(BIN)/python -c "import moegrad; moegrad.warm_up()" & kernel=$$!; \
	$(BIN)/python -c "import moegrad.accuracy; moegrad.accuracy.warm_up_compare()" & compare=$$!; \
	$(BIN)/mypy; typed=$$?; wait $$kernel; compiled=$$?; wait $$compare; \
	[ $$? -eq 0 ] && [ $$compiled -eq 0 ] && [ $$typed -eq 0 ]
	MOEGRAD_MSPROBE_TEST_PATH=$(MSPROBE_DIR) $(BIN)/python -m pytest -q $(PYTEST_LANES) -m "not serial and not slow" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m "serial and not slow" $(PYTEST_ARGS)

test-all: test
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

serve: $(SERVE_STAMP)
	$(BIN)/moegrad-service serve $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(if $(BACKEND),--backend $(BACKEND))

bench: $(STAMP)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .lock-venv build dist .pytest_cache
