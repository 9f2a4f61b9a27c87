# Every target installs what it needs into .venv first, so each works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint typecheck mutate demo docs bench reproduce clean gpu-check gpu-wheels

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch: a bare "torch" requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,examples,docs,mnist,lightning]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check pyro_vinit tests examples benchmarks docs tools

# `mypy --strict` (configured in pyproject.toml) checks the whole package.
TYPED_MODULES ?= pyro_vinit

typecheck: $(STAMP)
	$(BIN)/mypy $(TYPED_MODULES)

# The suite on two workers (pytest-xdist), one torch thread each (tests/conftest.py), tests
# handed out two at a time, so that the slow smoke runs sorted first spread over both.
test: $(STAMP)
	$(BIN)/ruff check pyro_vinit tests examples benchmarks docs tools
	$(BIN)/mypy $(TYPED_MODULES)
	$(BIN)/python -m pytest -q -n 2 --maxschedchunk 2 tests

# Mutation testing, a developer tool (not run in CI): mutates MUTATE_MODULES
# (packages or .py files) and runs MUTATE_TESTS against each mutant, on one worker.
# e.g. make mutate MUTATE_MODULES=pyro_vinit/poutine MUTATE_TESTS=tests/poutine
MUTATE_MODULES ?= pyro_vinit/distributions pyro_vinit/initialization/bayesian_linear_regression.py
MUTATE_TESTS ?= tests/distributions tests/initialization/test_bayesian_linear_regression.py

mutate: $(STAMP)
	$(BIN)/pip install -q -e ".[dev]"
	OMP_NUM_THREADS=1 $(BIN)/python tools/mutate.py --modules $(MUTATE_MODULES) \
		--tests $(MUTATE_TESTS)

demo: $(STAMP)
	$(BIN)/python examples/quick_start.py

docs: $(STAMP)
	$(BIN)/sphinx-build -W -b html docs docs/_build/html

# NumPyro, the race's (bench_time_to_quality.py) one peer outside torch, in a venv of its own: jax
# beside torch would double the memory and fight over threads. Where jax does not install, the
# race skips NumPyro and says so.
NUMPYRO_VENV ?= .venv-numpyro

$(NUMPYRO_VENV)/.installed:
	$(PYTHON) -m venv $(NUMPYRO_VENV)
	$(NUMPYRO_VENV)/bin/pip install -q numpyro==0.22.0 jax==0.10.2 jaxlib==0.10.2 \
		&& touch $@ || echo "jax / NumPyro did not install: the race skips NumPyro"

# bayesian-torch and IVON (ivon-opt, GPL-3.0) are peers of the benchmarks only, never the
# library's dependencies (not an extra); --no-deps: bayesian-torch's declared requirements
# (torchvision, tensorboard) are not used by its layers, and torchvision could pull another
# torch build than the CPU one above; ivon-opt declares none.
bench: $(STAMP)
	$(BIN)/pip install -q --no-deps bayesian-torch==0.5.0 ivon-opt==0.1.3
	-$(MAKE) $(NUMPYRO_VENV)/.installed
	$(BIN)/python -m benchmarks.bench_targets
	$(BIN)/python -m benchmarks.bench_floor
	$(BIN)/python -m benchmarks.bench_guides
	$(BIN)/python -m benchmarks.bench_lrt_step
	$(BIN)/python -m benchmarks.bench_gradient_variance
	$(BIN)/python -m benchmarks.bench_scaling
	$(BIN)/python -m benchmarks.bench_iblm_time
	$(BIN)/python -m benchmarks.bench_iblm_memory
	$(BIN)/python -m benchmarks.bench_memory
	$(BIN)/python -m benchmarks.bench_time_to_quality --numpyro-python $(NUMPYRO_VENV)/bin/python

# The GPU check (benchmarks/gpu_check.py, docs/performance.rst): the device-aware tests on
# CUDA, step times, I-BLM's time and the captured step's float32 agreement, under 8 minutes on
# one H100. It runs with the machine's own Python and CUDA torch (no .venv, no internet): the
# pure-Python wheels it needs besides (Pyro, bayesian-torch, ...) are taken from GPU_WHEELS,
# which `make gpu-wheels` fills on a machine with internet, into a folder of their own.
GPU_PYTHON ?= python3
GPU_WHEELS ?= gpu-wheels
GPU_DEPS ?= .gpu-deps
GPU_CHECK_ARGS ?=

gpu-wheels: $(STAMP)
	$(BIN)/pip download -q --no-deps -d $(GPU_WHEELS) pyro-ppl==$$($(BIN)/python -c \
		"import pyro; print(pyro.__version__)") pyro-api==0.1.2 opt-einsum==3.4.0 \
		bayesian-torch==0.5.0 pytest tqdm iniconfig pluggy

gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --upgrade --target $(GPU_DEPS) $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(CURDIR):$(CURDIR)/$(GPU_DEPS) $(GPU_PYTHON) -m benchmarks.gpu_check --device cuda $(GPU_CHECK_ARGS)

# The papers' results on real MNIST (docs/reproducing.rst): JSON, figures and tables into
# docs/_static/reproduce/. About 23 minutes of CPU time on one thread.
reproduce: $(STAMP)
	$(BIN)/python -m benchmarks.reproduce.ktied
	$(BIN)/python -m benchmarks.reproduce.radial
	$(BIN)/python -m benchmarks.reproduce.lrt
	$(BIN)/python -m benchmarks.reproduce.ood
	$(BIN)/python -m benchmarks.reproduce.iblm

clean:
	rm -rf $(VENV) $(NUMPYRO_VENV) $(GPU_DEPS) docs/_build build *.egg-info .mypy_cache
