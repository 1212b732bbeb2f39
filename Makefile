# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make demo   - create .venv, install autopar, plan the bundled ResNet-50 on 8 Ascend 910 devices
#   make test   - create .venv, install autopar with its test and lint extras, then lint, type-check and test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORE := $(VENV)/.core
STAMP := $(VENV)/.installed

.PHONY: demo test lint pytest wheel-check bench clean

# planning needs only the core (numpy, onnx, pydantic): the demo installs that much;
# --no-cache-dir: the test extras fill about 4.5 GB (mindspore 2.5), and pip's cache would keep a second copy of every wheel it downloads
$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-cache-dir -e .
	touch $(CORE)

# the tests also run torch, jax, mindspore, onnxruntime, highspy and the linters
$(STAMP): $(CORE)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-cache-dir -e ".[test,lint]"
	touch $(STAMP)

demo: $(CORE)
	$(BIN)/autopar plan models/resnet50.onnx --devices 8

# gates first (tinygrad, Alpa): lint and types must pass before the tests run
test: lint pytest

lint: $(STAMP)
	$(BIN)/ruff check autopar tests bench models examples
	$(BIN)/ruff format --check autopar tests bench models examples
	$(BIN)/mypy

# two workers, a test file each at a time (its fixtures built once): the suite's torch tests run eight ranks
# of their own, the rest one core, so a two-core machine runs it in about three fifths of the time
pytest: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile

# the wheel a user installs (not the editable install) carries every package: report included
wheel-check: $(STAMP)
	bash .ci/wheel_check

bench: $(STAMP)
	$(BIN)/python bench/plan_time.py
	$(BIN)/python bench/calibrate.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache dist build
