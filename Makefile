# Developer entry points. Each target installs what it needs into its venv first (CPU torch unless a torch is
# already importable there), so all work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
SRC ?= assets/esm2_tiny
# The lowest transformers the whole suite passes with; must equal pyproject.toml's lower bound (check-pins checks).
TRANSFORMERS_OLDEST := 5.6.0
# An exact transformers version for the venv (empty: the newest pip resolves). `suite` insists on it, so a venv
# made with another version fails instead of testing the wrong one. E.g. make test VENV=/tmp/v TRANSFORMERS_PIN=5.15.1
TRANSFORMERS_PIN ?=
# Which tests `suite` runs (pytest -m): the fast set by default; `slow` (pyproject.toml says what it marks) is the rest.
MARKS ?= not slow
# pytest-xdist workers (auto: one a core); JOBS=0 runs the tests in this process (e.g. for pdb).
JOBS ?= auto

.PHONY: demo test test-slow lint suite check-pins test-transformers-oldest gpu-test

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' $(if $(TRANSFORMERS_PIN),'transformers==$(TRANSFORMERS_PIN)')
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py $(SRC)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

check-pins:
	@grep -qF '"transformers>=$(TRANSFORMERS_OLDEST),' pyproject.toml || { \
	  echo "Makefile: TRANSFORMERS_OLDEST=$(TRANSFORMERS_OLDEST) is not the lower bound in pyproject.toml:"; \
	  grep -F '"transformers' pyproject.toml; exit 1; }

# The tests MARKS selects, after printing the versions they run with (so the CI log records the tested range).
suite: $(VENV)/.installed
	@$(PY) -c "import torch, transformers as t; print('transformers', t.__version__, '| torch', torch.__version__); \
	  assert '$(TRANSFORMERS_PIN)' in ('', t.__version__), '$(VENV) does not hold transformers $(TRANSFORMERS_PIN)'"
	$(PY) -m pytest -q -m "$(MARKS)" -n $(JOBS)

# `make test`: ruff, then the fast set. The README's commands run in the venv: say how to reach them (make runs $(PY)
# without activating it).
test: check-pins lint suite
	@echo "Next, the README's Quickstart in $(VENV): source $(VENV)/bin/activate (or $(abspath $(VENV))/bin/nv-esm)"

# The slow tests (torchrun and command launches, the longest checks): with `make test`, the whole suite.
test-slow: check-pins
	$(MAKE) suite MARKS=slow

# The fast set again, in its own venv, with the lowest transformers that pyproject.toml allows.
test-transformers-oldest: check-pins
	$(MAKE) suite VENV=.venv-oldest TRANSFORMERS_PIN=$(TRANSFORMERS_OLDEST)
