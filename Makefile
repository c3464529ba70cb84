# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One worker per core of CI's two: timing-sensitive end-to-end tests (a replay within 10% of the twin) need the room.
TEST_WORKERS ?= 2
FAST_TESTS := tests/test_core_*.py tests/test_properties.py tests/test_twin.py tests/test_config.py tests/test_traces.py \
	tests/test_units.py tests/test_mig_*.py tests/test_growth.py

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps --target $(VENV)/torchvision torchvision==0.28.0  # validation/models
	touch $(STAMP)

demo: setup
	$(BIN)/carma simulate --trace carma-t1 --sweep --csv results/sweep-carma-t1.csv --plot results/plots \
		--save results/sweep-carma-t1.json
	$(BIN)/carma report results/sweep-carma-t1.json --out results/report

test: setup
	$(BIN)/ruff check src tests benchmarks validation scripts
	$(BIN)/ruff format --check src tests benchmarks validation scripts
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=30

# The edit loop: layering, the decision core, the twin, the configuration and the traces, in seconds not minutes.
test-fast: setup
	$(BIN)/lint-imports --no-cache --no-logo
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(FAST_TESTS)

bench: setup
	$(BIN)/python benchmarks/twin_speed.py
	$(BIN)/python benchmarks/server_bench.py
	$(BIN)/python benchmarks/dashboard_bench.py
	$(BIN)/python benchmarks/fake_gpu_bench.py
	$(BIN)/python benchmarks/mig_partition.py
	$(BIN)/python benchmarks/estimators.py

clean:
	rm -rf $(VENV) results .pytest_cache .ruff_cache
