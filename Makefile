# One command to set up and start, one to test. Everything installs from this repository's files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up demo setup test browser bench clean

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

test: setup browser ## the whole test suite
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/train_throughput.py --quick
	$(BIN)/python bench/server_load.py --skip-anchor
	$(BIN)/python bench/detection.py
	$(BIN)/python bench/ui.py

clean:
	rm -rf $(VENV) tokenpulse-data tokenpulse-agent test-artifacts
