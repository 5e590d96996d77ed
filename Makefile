# duipai: `make all` runs every backend on the default model and data; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.duipai-installed

.PHONY: all test test-slow bench install clean

all: $(STAMP)
	$(BIN)/duipai all

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

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
