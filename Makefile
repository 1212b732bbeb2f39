# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make demo   - create .venv, install autopar, plan the bundled ResNet-50 on 8 Ascend 910 devices
#   make test   - create .venv, install autopar with its test extras, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/autopar plan models/resnet50.onnx --devices 8

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/plan_time.py
	$(BIN)/python bench/calibrate.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
