# The targets people expect. `make test` and `make demo` set everything up first.
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := proxy relay worker_client sdk

.PHONY: setup check lint typecheck test demo up bench clean

setup:
	./scripts/setup.sh

lint:
	$(BIN)/ruff check $(PACKAGES) tests
	$(BIN)/ruff format --check $(PACKAGES) tests

typecheck:
	$(BIN)/mypy

check: lint typecheck

test: setup check
	$(BIN)/pytest -q tests

demo: setup
	$(BIN)/rollout-relay demo

up: setup
	$(BIN)/rollout-relay up

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
