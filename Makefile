# Each target creates the virtual environment when it is missing, so a fresh clone needs only
# `make demo` (the main job) or `make test` (the test suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 takes the CPU build where no CUDA build is wanted; triton and transformers are
# pinned to the versions of the GPU machine so both test the same thing; numpy below 2.4 for
# Triton 3.6's interpreter (tigon._versions.check_interpreter_numpy).
PINS := torch==2.13.0 triton==3.6.0 numpy<2.4

.PHONY: check test typecheck bench demo docs wheel-check clean

$(BIN)/tigon: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(foreach pin,$(PINS),'$(pin)')
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: $(BIN)/tigon
	$(BIN)/tigon demo

check: $(BIN)/tigon
	$(BIN)/tigon check

test: $(BIN)/tigon
	$(BIN)/python -m pytest -q

# The public API's type hints, checked by mypy ([tool.mypy] in pyproject.toml).
typecheck: $(BIN)/tigon
	$(BIN)/mypy

bench: $(BIN)/tigon
	$(BIN)/tigon bench

# The docs site, warnings as errors, into site/; the docs extra joins the venv when missing.
$(BIN)/mkdocs: $(BIN)/tigon
	$(BIN)/pip install --quiet -e ".[docs]"
	touch $@

docs: $(BIN)/mkdocs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The wheel as a user installs it, outside the checkout: build, install, check, bench, demo.
wheel-check:
	PYTHON=$(PYTHON) PINS='$(PINS)' .ci/wheel-check

clean:
	rm -rf $(VENV)
