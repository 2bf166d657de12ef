# Every target prepares .venv itself, so a fresh clone needs only `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The variables these targets read; one given on the command line that is not
# among them is refused (a misspelled SOAK_SECOND=60 would otherwise run the
# hour-long default without a word).
KNOWN_VARIABLES := PYTHON TEST_JOBS FAULT_JOBS PYTEST_ARGS SOAK_SECONDS DEMO_ARGS \
  BENCH_ARGS MEMORY_MINUTES MODEL_ARGS
UNKNOWN_VARIABLES := $(filter-out $(KNOWN_VARIABLES),$(foreach v,$(.VARIABLES),\
  $(if $(filter command line,$(origin $(v))),$(v))))
ifneq ($(UNKNOWN_VARIABLES),)
$(error unknown variable(s) $(UNKNOWN_VARIABLES); this Makefile reads $(KNOWN_VARIABLES))
endif

.PHONY: venv test test-store lint typecheck demo bench bench-quick bench-memory model clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

# TEST_JOBS test processes side by side (pytest-xdist): most tests wait on
# real workers, leases and outages. Each test has a database of its own, each
# process a Redis database of its own (tests/services.py), and the tests on the
# shared RabbitMQ run in one process (tests/conftest.py). TEST_JOBS=0: serially.
TEST_JOBS ?= 3
FAULT_JOBS ?= 3

test: venv
	$(BIN)/pytest -n $(TEST_JOBS) --dist loadgroup $(PYTEST_ARGS)

# The core store tests alone (CI also runs them against the embedded server).
test-store: venv
	$(BIN)/pytest tests/test_store.py tests/test_producer.py tests/test_migrate.py $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check outbox_relay tests benchmarks
	$(BIN)/ruff format --check outbox_relay tests benchmarks
	$(BIN)/mypy

typecheck: venv
	$(BIN)/mypy

.PHONY: faults soak

# Only the fault suite, with its ledgers printed as the table of docs/reliability.md.
faults: venv
	rm -f .faults.jsonl
	# The table also when a scenario failed (its row shows the unexplained).
	OUTBOX_TEST_FAULTS_REPORT=$(CURDIR)/.faults.jsonl $(BIN)/pytest -m faults -n $(FAULT_JOBS) \
	  --dist loadgroup $(PYTEST_ARGS); status=$$?; \
	  $(BIN)/python -m tests.faults.report .faults.jsonl; exit $$status

# The soak alone, an hour by default (SOAK_SECONDS=...); draws docs/reliability-soak.png
# for the hour, .soak.png for a shorter one.
SOAK_SECONDS ?= 3600
soak: venv
	$(BIN)/pip install --quiet -e ".[dev,soak]"
	OUTBOX_TEST_SOAK_SECONDS=$(SOAK_SECONDS) OUTBOX_TEST_SOAK_CSV=$(CURDIR)/.soak.csv \
	  $(BIN)/pytest tests/faults/test_soak.py --timeout=0 $(PYTEST_ARGS)
	$(BIN)/python -m tests.faults.report --plot .soak.csv \
	  $(if $(filter 3600,$(SOAK_SECONDS)),docs/reliability-soak.png,.soak.png)

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

# The same scenarios at small sizes, one round (a smoke test: prints the
# table, asserts nothing about speed); writes benchmarks/results/quick.md.
bench-quick: venv
	$(BIN)/python -m benchmarks.run --quick $(BENCH_ARGS)

# The relay at a steady 1,000 messages/s for MEMORY_MINUTES (30): worker
# memory, connections and backlog sampled every 10 s; writes
# benchmarks/results/memory.md and memory.csv.
MEMORY_MINUTES ?= 30
bench-memory: venv
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	$(BIN)/python -m benchmarks.memory --minutes $(MEMORY_MINUTES) $(BENCH_ARGS)

# The protocol model (model/relay.pml) checked with Spin, about a minute;
# needs spin and gcc (apt-get install -y spin gcc). See docs/model.md.
# More: make model MODEL_ARGS=--full (the wider sizes, about 10 minutes).
model:
	model/check.sh $(MODEL_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
