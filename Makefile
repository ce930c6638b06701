# Two commands from a fresh clone: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,xprof,ray]'
	# The [tpu-compile] / [gpu-compile] wheels (libtpu, the CUDA plugin; about 1.2 GB) go into
	# $(VENV)/compile-only, outside site-packages: there every `import jax` would load them (CUDA driver
	# warnings, a TPU probe). Only moe-tune's compile worker processes put that folder on their path.
	$(PY) -m moe_tune.targets.wheels install
	touch $(STAMP)

# A real sweep of ragged_dot tile sizes at a realistic MoE expert shape on this machine, then the report,
# then a fresh Python process that shows moe_tune.ragged_dot picking the tuned entry up. The sweep measures
# its whole grid every time: --cold (no warm start from entries tuned nearby) and --fresh (no resuming an
# earlier demo's log).
demo: $(STAMP)
	$(VENV)/bin/moe-tune sweep --op ragged_dot --cold --fresh
	$(VENV)/bin/moe-tune report --op ragged_dot
	$(PY) -m moe_tune.commands.demo_check

# The suite is CPU-bound (JAX compiles, interpret-mode Pallas): two pytest-xdist workers on CI's 2 cores (about
# 21 minutes of pytest on a fresh clone here, 1233 s on 2026-12-02, over the 15-minute budget).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q --durations=15 --numprocesses=$(TEST_WORKERS)

# Every CPU performance target and its measured ratio (about 40 minutes on 2 cores).
bench: $(STAMP)
	$(PY) benchmarks/targets_cpu.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
