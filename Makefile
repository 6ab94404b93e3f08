# The two commands of the README, and the test tiers on their own. All install first (idempotent).
# `make test` runs every tier in order, unit -> integration -> e2e (tests/conftest.py sorts them), so a broken build
# fails in the first seconds; each run writes every test's seconds, per tier and slowest first, to test-durations.txt.
.PHONY: install run test test-unit test-integration test-fast

install:
	./scripts/install.sh

run: install
	.venv/bin/vime-pipeline --config configs/tiny-cpu.yaml

test: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -v --durations=25

test-unit: install
	.venv/bin/python -m pytest -v tests/unit

test-integration: install
	.venv/bin/python -m pytest -v tests/integration

test-fast: install
	.venv/bin/python -m pytest -v tests/unit tests/integration
