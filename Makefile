# Two commands do everything on a fresh machine with Python >= 3.10 and make:
#   make demo   creates .venv, installs Spillway with every part (.[all]), runs the demo story
#   make test   creates .venv, installs Spillway with the dev extra, runs lint, types and the whole suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint typecheck pytest docs clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit("Spillway needs Python >= 3.10, found " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[all]'
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/spillway demo

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

pytest: $(VENV)/.installed-dev
	$(BIN)/pytest

# The documentation site: regenerate the CLI, configuration and REST references from the code, then build strictly
# into site/ (a broken link, a missing anchor or a page outside the nav fails). pytest checks both too.
docs: $(VENV)/.installed-dev
	$(BIN)/python tools/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The type check (about a minute, mostly one core) runs beside the suite (mostly waiting on servers and processes):
# CI's whole run stays inside its budget. A failure of either fails `make test`.
test: lint
	@$(MAKE) --no-print-directory -j2 typecheck pytest

clean:
	rm -rf $(VENV) .spillway-demo .pytest_cache .mypy_cache .ruff_cache site
