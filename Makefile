# Meridian: everything runs from a virtual environment inside the repo (.venv), built from
# pinned versions (requirements.lock). `make test` and `make bench-sim` create it when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint typecheck unit bench-sim clean

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml scripts/install-fabrics.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	VENV=$(VENV) bash scripts/install-fabrics.sh
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

typecheck: venv
	$(BIN)/mypy src scripts/gen_docs.py

unit: venv
	$(BIN)/python -m pytest -q

## The whole test suite: lint, types, tests.
test: lint typecheck unit

## The main job: the default simulator A/B (Meridian against the baselines).
bench-sim: venv
	$(BIN)/meridian bench sim

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
