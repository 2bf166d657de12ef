# Every target prepares .venv itself, so a fresh clone needs only `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv test test-store lint typecheck demo bench model clean

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

# The whole relay end to end on this machine (~20 s): embedded PostgreSQL and
# Redis from pip packages unless OUTBOX_DSN / CELERY_BROKER_URL are set.
# More: make demo DEMO_ARGS="--orders 1000 --keep-running"
demo: venv
	$(BIN)/outbox-relay demo $(DEMO_ARGS)

# Side-by-side throughput and latency figures (several minutes); writes
# benchmarks/results/latest.md. Uses OUTBOX_BENCH_DSN / OUTBOX_BENCH_REDIS_URL
# when set, else embedded servers. More: make bench BENCH_ARGS="--messages 5000"
bench: venv
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

# The protocol model (model/relay.pml) checked with Spin, about a minute;
# needs spin and gcc (apt-get install -y spin gcc). See docs/model.md.
# More: make model MODEL_ARGS=--full (the wider sizes, about 10 minutes).
model:
	model/check.sh $(MODEL_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
