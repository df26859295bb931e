# Two commands do all the set-up: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,postgres]'
	touch $(STAMP)

# Four workers on a 2-core machine: the end-to-end tests mostly wait on real processes (daemons, sshd, simulated
# clouds), so at two workers the cores sat about 45 % idle. Measured on the same tree: 13 min 49 s with three against
# 16 min 29 s to 17 min 0 s with two; on 2026-12-03, back to back on a slower day, 16 min 59 s with four against
# 18 min 6 s with three (one run each, every test passing). On 2026-12-05, with 1439 tests on a quiet machine, four
# took 16 min 40 s and five 16 min 56 s, the CPU-bound replays of test_simulate.py twice as long (184 s against 89 s).
# Files go out longest first (tests/conftest.py), hence --no-loadscope-reorder.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder --durations=15

demo: $(STAMP)
	$(BIN)/burstctl demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
