# Everything installs into .venv from the package registries; only Python 3.10+ and make
# are needed. Without DRAMATIQ_PG_URL (demo) or DRAMATIQ_PG_TEST_URL (tests), a local
# PostgreSQL from the pgserver package is started and reused.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp

.PHONY: install lint format test test-fast demo bench clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The demo needs the broker, the admin API and the local PostgreSQL, not the test tools.
$(DEMO_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $(DEMO_STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## The test command: lint, then every test against real PostgreSQL.
test: lint
	$(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS)

## Unit and integration tests only (no real worker processes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit tests/integration $(PYTEST_ARGS)

## The demo: database, migrations, workers, admin API and sample jobs. Ctrl-C stops it.
demo: $(DEMO_STAMP)
	$(BIN)/python -m demo_actors.run $(DEMO_ARGS)

## Side-by-side benchmarks against Dramatiq's Redis and RabbitMQ brokers.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
