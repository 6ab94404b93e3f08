# The two commands of the README, and the test tiers on their own. All install first (idempotent).
# `make test` runs every tier in order, unit -> integration -> e2e (tests/conftest.py sorts them), so a broken build
# fails in the first seconds; each run writes every test's seconds, per tier and slowest first, to test-durations.txt.
# JOBS pytest-xdist workers share the tests a file at a time (a file's module fixtures are set up once): most e2e time
# is spent waiting (servers, outages, engine start), so two workers on 2 cores finish sooner. JOBS=0 runs serially.
JOBS ?= 2
PYTEST = .venv/bin/python -m pytest -v -n $(JOBS) --dist loadfile
.PHONY: install run test test-unit test-integration test-fast

install:
	./scripts/install.sh

run: install
	.venv/bin/vime-pipeline --config configs/tiny-cpu.yaml

test: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	$(PYTEST) --durations=25

test-unit: install
	$(PYTEST) tests/unit

test-integration: install
	$(PYTEST) tests/integration

test-fast: install
	$(PYTEST) tests/unit tests/integration
