# Every target prepares .venv itself, so a fresh clone needs only `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test test-store lint typecheck demo bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/pytest $(PYTEST_ARGS)

# The core store tests alone (CI also runs them against the embedded server).
test-store: venv
	$(BIN)/pytest tests/test_store.py tests/test_producer.py tests/test_migrate.py $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check outbox_relay tests benchmarks
	$(BIN)/ruff format --check outbox_relay tests benchmarks
	$(BIN)/mypy

typecheck: venv
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
