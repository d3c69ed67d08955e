# Everything installs into .venv from the package registries; only Python 3.10+ and make
# are needed. Without DRAMATIQ_PG_URL (demo) or DRAMATIQ_PG_TEST_URL (tests), a local
# PostgreSQL from the pgserver package is started and reused; it keeps running until
# `make stop`. It is this checkout's: its data is in .pgdata/ here (git-ignored), so
# `make stop` in another checkout leaves it alone.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp
# This checkout's embedded server, whichever virtualenv runs it (VENV may be shared).
export DRAMATIQ_PG_EMBEDDED_DIR ?= $(CURDIR)/.pgdata/data

.PHONY: install lint format test test-fast demo stop docs dist bench clean

# pip prints what it collects and installs: the first install takes a minute or two.
$(STAMP): setup.cfg pyproject.toml
	@echo "Installing the package and its dev extra into $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[dev]'
	touch $(STAMP)

# The demo needs the broker, the admin API and the local PostgreSQL, not the test tools.
$(DEMO_STAMP): setup.cfg pyproject.toml
	@echo "Installing the package and its demo extra into $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[demo]'
	touch $(DEMO_STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## The test command: lint, then every test against real PostgreSQL, in three runs. First
## all but the "alone" ones, in TEST_WORKERS parallel pytest-xdist workers (more than the
## cores: most tests wait on PostgreSQL and on child processes), each test module whole on
## one worker and the slow ones handed out first (tests/conftest.py). Then the few marked
## "alone", which time server outages to the second, each module on a server of its own,
## side by side in ALONE_WORKERS workers; last, serially, those that time an event loop to
## the millisecond ("loop_timing"). Each test's name is printed as it starts and as it ends
## (-v). PYTEST_ARGS=-n0 runs every part serially; a selection in PYTEST_ARGS that leaves a
## run without a test (pytest's exit status 5) is not a failure.
## Python writes its bytecode caches (__pycache__, git-ignored) during the run even where
## PYTHONDONTWRITEBYTECODE is set: otherwise every pytest process and every worker, gunicorn
## and CLI process the tests start compiles the package and rewrites the tests anew.
## Four workers: on two cores the run is bound by the CPU more than by waiting, and six
## exhausted the embedded server's 100 connections. With four, the run holds at most 64
## connections at once (sampled from pg_stat_activity every 0.1 s, 2026-12-04): a server
## with the default max_connections of 100 is enough.
TEST_WORKERS ?= 4
ALONE_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -v -p no:cacheprovider --durations=10
test: export PYTHONDONTWRITEBYTECODE =
test: lint
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not alone" \
		$(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PYTEST) -n $(ALONE_WORKERS) --dist loadfile -m "alone and not loop_timing" \
		$(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PYTEST) -n0 -m loop_timing $(PYTEST_ARGS) || [ $$? -eq 5 ]

## Unit and integration tests only (no real worker processes).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit tests/integration $(PYTEST_ARGS)

## The demo: database, migrations, workers, admin API and sample jobs. Ctrl-C stops it.
demo: $(DEMO_STAMP)
	$(BIN)/python -m demo_actors.run $(DEMO_ARGS)

## Stop this checkout's embedded PostgreSQL (the demo and the tests start it without a
## database URL); another checkout's keeps running.
stop:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m dramatiq_pg_broker embedded stop; \
	else echo "no $(VENV): nothing was started"; fi

## The documentation site, in docs/_build/html; a warning fails the build.
docs: $(STAMP)
	$(BIN)/python -m sphinx -W --keep-going -b html -q docs docs/_build/html
	@echo "docs: file://$(CURDIR)/docs/_build/html/index.html"

## The release files, in dist/: an sdist and a wheel, checked by twine.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

## Side-by-side benchmarks against Dramatiq's Redis and RabbitMQ brokers and PostgreSQL's
## own floor; BENCH_ARGS="--quick", or "--against 994d6c9" to compare an earlier release.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache docs/_build
