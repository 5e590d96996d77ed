# duipai: `make all` runs every backend on the default model and data; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.duipai-installed
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all test test-slow bench check baselines install clean

# every run is one process with one compute thread, so one run per core
all: $(STAMP)
	$(BIN)/duipai all -j $(JOBS)

# the tests spread over the cores (pytest-xdist; each test's backend processes use one compute thread)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal --durations=20

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal -m slow

# rerun the CI matrix against the committed golden baselines (results/baselines/ci/), docs/ci.md
check: $(STAMP)
	$(BIN)/duipai check -j $(JOBS)

# regenerate those baselines after an intended change; prints what changed
baselines: $(STAMP)
	$(BIN)/duipai check --update -j $(JOBS)

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

install: $(STAMP)

# the virtualenv is created if there is none; the project is installed with every backend
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all]'
	touch $(STAMP)

clean:
	rm -rf results/.tmp results/.failed .pytest_cache
