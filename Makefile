# One command to set up and start, one to test. Everything installs from this repository's files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up demo setup test browser postgres slurm bench clean

up: setup ## set up (first time) and start the server with an embedded worker
	$(BIN)/tokenpulse up

demo: setup ## same, and submit the demo job at once
	$(BIN)/tokenpulse up --demo

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

browser: ## Debian's Chromium and ChromeDriver for the UI tests (never a downloaded browser)
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  apt-get update -q && apt-get install -y -q chromium chromium-driver; fi

postgres: ## Debian's PostgreSQL server binaries for the tests on PostgreSQL (each run starts its own cluster)
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; fi

slurm: ## Debian's Slurm and munge for tests/test_slurm.py (each run starts its own munged, slurmctld and slurmd)
	@if ! command -v slurmctld >/dev/null 2>&1 && ! test -x /usr/sbin/slurmctld; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; fi

# The files that talk to the store run again on PostgreSQL (tests/pg.py starts a throwaway cluster):
# the server, ingest, storage, reaper, multi-process and agent-socket tests. The training, UI and CLI
# files exercise the same server paths through the same routes, so they run on SQLite only (time).
# The whole suite on PostgreSQL: TOKENPULSE_TEST_DB=postgresql .venv/bin/python -m pytest -q
PG_TESTS := tests/test_api.py tests/test_ingest.py tests/test_security.py tests/test_fuzz.py \
	tests/test_boundaries.py tests/test_series.py tests/test_series_reader.py tests/test_store.py \
	tests/test_reaper.py tests/test_hub.py tests/test_durability.py tests/test_queue_resilience.py \
	tests/test_migrations.py tests/test_multiserver.py tests/test_agent_channel.py tests/test_operations.py \
	tests/test_sessions.py tests/test_spine.py tests/test_errors.py tests/test_hardening.py tests/test_nonfinite.py

# Test files run side by side (pytest-xdist, a file per worker at a time: module fixtures are built
# once): most of a test is waiting on servers, agents and training processes, not using a core.
# (5 workers, or the PostgreSQL pass beside the SQLite one, was slower on 2 cores and flaky: measured.)
# Files in conftest's order, longest first: xdist's own reordering (most tests first) ran the long
# few-test files last, alone, while the other workers sat idle.
XDIST := -n 4 --dist loadfile --no-loadscope-reorder

test: setup browser postgres slurm ## the whole suite on SQLite, then the store-facing files on PostgreSQL
	$(BIN)/python -m pytest -q $(XDIST) --durations=15
	TOKENPULSE_TEST_DB=postgresql $(BIN)/python -m pytest -q $(XDIST) --durations=15 $(PG_TESTS)

bench: setup
	$(BIN)/python bench/train_throughput.py --quick
	$(BIN)/python bench/server_load.py --skip-anchor
	$(BIN)/python bench/detection.py
	$(BIN)/python bench/ui.py

clean:
	rm -rf $(VENV) tokenpulse-data tokenpulse-agent test-artifacts
