# Developer entry points. Each target installs what it needs into .venv first (CPU torch unless a torch is
# already importable there), so both work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
SRC ?= assets/esm2_tiny

.PHONY: demo test lint gpu-test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py $(SRC)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(VENV)/.installed lint
	$(PY) -m pytest -q
