# The two commands of the README, and the test tiers on their own. All install first (idempotent).
# `make test` runs every tier in order, unit -> integration -> e2e, each its own pytest run, so a broken build fails
# in the first seconds and no tier's tests share a process with a later tier's (an e2e test's engines leave torch
# state behind that a unit test does not expect). Each run writes its tests' seconds, per tier and slowest first, to
# test-durations.txt (tests/conftest.py keeps the other tiers' rows there).
# The integration and e2e tiers run on JOBS pytest-xdist workers, a file at a time (a file's module fixtures are set
# up once): most of their time is waiting (servers, outages, engine start), so two workers finish sooner on 2 cores.
# JOBS=0 runs them serially.
JOBS ?= 2
PYTEST = .venv/bin/python -m pytest -v
XDIST = -n $(JOBS) --dist loadfile
.PHONY: install run test test-unit test-integration test-e2e test-fast

install:
	./scripts/install.sh

run: install
	.venv/bin/vime-pipeline --config configs/tiny-cpu.yaml

test: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	$(PYTEST) tests/unit
	$(PYTEST) $(XDIST) tests/integration
	$(PYTEST) $(XDIST) --durations=25 tests/e2e

test-unit: install
	$(PYTEST) tests/unit

test-integration: install
	$(PYTEST) $(XDIST) tests/integration

test-e2e: install
	$(PYTEST) $(XDIST) tests/e2e

test-fast: install
	$(PYTEST) tests/unit
	$(PYTEST) $(XDIST) tests/integration
