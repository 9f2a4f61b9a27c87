# Every target installs what it needs into .venv first, so each works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo docs bench clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch: a bare "torch" requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,examples,docs,mnist]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check pyro_vinit tests examples benchmarks docs

test: $(STAMP)
	$(BIN)/ruff check pyro_vinit tests examples benchmarks docs
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/python examples/quick_start.py

docs: $(STAMP)
	$(BIN)/sphinx-build -W -b html docs docs/_build/html

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_guides.py
	$(BIN)/python benchmarks/bench_lrt.py
	$(BIN)/python benchmarks/bench_iblm_time.py

clean:
	rm -rf $(VENV) docs/_build build *.egg-info
