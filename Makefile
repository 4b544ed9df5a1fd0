VENV ?= .venv
PY := $(VENV)/bin/python
SEED ?= 1
TRIALS ?= 200
MINUTES ?= 5
EPOCHS ?= 10000
SINKS ?= parquet,delta,delta-part,iceberg,iceberg-part
LONGRUN_ARGS ?=
# The default run: unit, integration, spark, a seeded chaos sample and the cluster layer
# (a multi-node Ray on this machine, run last); `slow`, `kafka_cluster` and `upgrade` are
# left out.
PYTEST_ARGS ?= -m "not slow and not kafka_cluster and not upgrade"
# `make check`: one short runtime test per sink (Parquet, Delta, Iceberg, PostgreSQL, Kafka),
# each through real actors into its real target, after the unit tests.
CHECK_TESTS := tests/integration/test_runtime.py::test_replayed_epoch_is_skipped \
	tests/integration/test_sinks_runtime.py::test_epochs_replays_coordinator_crashes_and_status_running_paused_dropped \
	tests/kafka/test_kafka_sink.py::test_epochs_exactly_once

.PHONY: setup check test unit demo chaos bench soak longrun lint typecheck dashboards kafka-cluster upgrade compat

setup:
	@bash scripts/setup.sh

# In four steps (scripts/run_tests.py): unit and integration, each on two pytest-xdist
# workers; kafka, then the cluster modules without Spark, beside spark, then chaos (a
# process of its own); the rest of cluster. One table at the end.
test: setup
	$(PY) scripts/run_tests.py $(PYTEST_ARGS)

# The loop before every commit (at most 4 minutes): lint, types, unit tests, then one short
# runtime test per sink.
check: setup
	$(VENV)/bin/ruff check raysink tests bench examples scripts
	$(VENV)/bin/mypy
	$(PY) -m pytest -m "not slow" -p no:cacheprovider -q tests/unit $(CHECK_TESTS)

# The low end of every dependency range (constraints/oldest.txt) in a venv of its own,
# cached under ~/.cache/raysink: the unit layer, one case per sink, door and fault, and the
# wheel installed clean running the demo (scripts/compat.sh). `make test` is the high end.
compat: setup
	bash scripts/compat.sh
	$(MAKE) upgrade

unit: setup
	$(PY) -m pytest -m unit -q

demo: setup
	$(VENV)/bin/raysink demo

# Trials named as goals (`make chaos SEED=29 TRIALS=40 -k t0021`, or `make t0021 SEED=29
# TRIALS=40`) run alone: the plan's other trials are deselected.
TRIAL_GOALS := $(filter t0% t1% t2% t3% t4% t5% t6% t7% t8% t9%,$(MAKECMDGOALS))
empty :=
space := $(empty) $(empty)

chaos: setup
	$(PY) -m pytest tests/chaos -m "chaos and not slow" --chaos-seed=$(SEED) --chaos-trials=$(TRIALS) -q $(if $(RESUME),--chaos-resume) $(if $(TRIAL_GOALS),-k "$(subst $(space), or ,$(strip $(TRIAL_GOALS)))")

ifneq ($(TRIAL_GOALS),)
$(TRIAL_GOALS): chaos
	@:
endif

# The sink against a KRaft controller and three brokers (tests/support/kafka_cluster.py):
# leaders and transaction coordinators killed mid-commit, a broker paused past its session
# timeout, a rolling restart during a stream.
kafka-cluster: setup
	$(PY) -m pytest tests/kafka_cluster -m kafka_cluster -q

# The upgrade test from this release's wheel (scripts/upgrade.sh): each stored previous
# release (tests/upgrade/releases, built again from its tag where the clone has it) killed
# with an epoch pending in every sink, then this one, installed into a fresh venv, takes
# over, with a SQLite and a PostgreSQL meta store. About 3 minutes to set up, 45-90 s a case.
upgrade: setup
	VENV=$(VENV) bash scripts/upgrade.sh

bench: setup
	$(PY) bench/spark_write.py
	$(PY) bench/spark_memory.py

# Minutes of steady writing; checks memory, mailbox, outstanding epochs, meta store, rows.
soak: setup
	$(PY) bench/soak.py --minutes $(MINUTES)

# A year of epochs, shortened (issue 37): EPOCHS small epochs per sink, epoch p50 of the
# first and last 500, files, metadata bytes, a fresh reader's (and Spark's) open and count,
# and issue 37's verdicts per sink; fails when one fails. Timing verdicts need a quiet
# machine; EPOCHS=10000 of the five sinks takes over an hour (it prints an estimate).
# LONGRUN_ARGS: more flags (--spark off, --maintenance off, --policy ..., --workdir ...).
longrun: setup
	PYTHONPATH=$(CURDIR) $(PY) bench/longrun.py --epochs $(EPOCHS) --sinks $(SINKS) $(LONGRUN_ARGS)

# Regenerate raysink/dashboards/raysink.json and alerts.yaml from their definitions.
dashboards: setup
	$(PY) -m raysink.dashboards

lint: setup
	$(VENV)/bin/ruff check raysink tests bench examples scripts
	$(VENV)/bin/mypy

typecheck: lint
