# The two commands of the README. Both install first (idempotent).
.PHONY: install run test test-fast

install:
	./scripts/install.sh

run: install
	.venv/bin/vime-pipeline --config configs/tiny-cpu.yaml

test: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -v --durations=25

test-fast: install
	.venv/bin/python -m pytest -v -m "not e2e"
