VENV ?= .venv
PY := $(VENV)/bin/python
SEED ?= 1
TRIALS ?= 200
MINUTES ?= 5
# The default run: unit, integration, spark, a seeded chaos sample and the cluster layer
# (a multi-node Ray on this machine, run last); `slow` is left out.
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup test unit demo chaos bench soak lint typecheck dashboards

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS) -p no:cacheprovider --durations=25

unit: setup
	$(PY) -m pytest -m unit -q

demo: setup
	$(VENV)/bin/raysink demo

chaos: setup
	$(PY) -m pytest tests/chaos -m chaos --chaos-seed=$(SEED) --chaos-trials=$(TRIALS) -q

bench: setup
	$(PY) bench/spark_write.py
	$(PY) bench/spark_memory.py

# Minutes of steady writing; checks memory, mailbox, outstanding epochs, meta store, rows.
soak: setup
	$(PY) bench/soak.py --minutes $(MINUTES)

# Regenerate raysink/dashboards/raysink.json and alerts.yaml from their definitions.
dashboards: setup
	$(PY) -m raysink.dashboards

lint: setup
	$(VENV)/bin/ruff check raysink tests bench examples
	$(VENV)/bin/mypy

typecheck: lint
