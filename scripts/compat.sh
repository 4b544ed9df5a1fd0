#!/usr/bin/env bash
# `make compat`: the low end of every dependency range. In the compat venv (the oldest
# release of each range, constraints/oldest.txt; scripts/compat_venv.sh builds it once and
# caches it under ~/.cache/raysink), against this clone's source (PYTHONPATH):
#   1. the versions it runs, each checked to be its range's low end;
#   2. the unit layer, on two pytest-xdist workers;
#   3. a representative set (INTEGRATION, KAFKA, SPARK below): every sink (Parquet, Delta, Iceberg,
#      PostgreSQL, Kafka), every door (write_arrow, write(df), foreach_batch, feeds, the
#      Ray Data datasink, streams) and one fault each, integration on two workers, then
#      the kafka and spark cases;
#   4. the package: `python -m build`, the wheel installed into a fresh venv with `[all]`,
#      `raysink demo` run from it (tests/package/test_wheel.py).
# 5-8 minutes on this 2-core machine with the venv cached, 7.5 from a fresh one (README,
# "Install and supported versions"). COMPAT_SKIP_UNIT=1 leaves the unit layer out.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(bash scripts/compat_venv.sh)
PY="$VENV/bin/python"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

echo "compat: the oldest versions, in $VENV"
"$PY" - <<'PY'
from importlib import metadata
from raysink.protocol.requirements import RANGES, release
wrong = []
for r in RANGES:
    found = metadata.version(r.package)
    print(f"  {r.package:16} {found:10} (range {r.spec})")
    if release(found) != release(r.low):
        wrong.append(f"{r.package} {found} is not its range's low end {r.low}")
if wrong:
    raise SystemExit("compat: " + "; ".join(wrong))
PY

# Each sink, each door, one fault each (node ids; file order is the run's order).
INTEGRATION=(
  # write_arrow into Parquet, several writers, epochs reordered
  tests/integration/test_runtime.py::test_many_epochs_through_several_writers_reordered
  # Delta, Iceberg and PostgreSQL: epochs, replays, coordinator crashes, status
  tests/integration/test_sinks_runtime.py::test_epochs_replays_coordinator_crashes_and_status_running_paused_dropped
  # PostgreSQL killed between pre-commit and commit
  tests/integration/test_sinks_runtime.py::test_postgres_restart_between_pre_commit_and_commit
  # feeds from Ray tasks and an actor; a killed producer
  tests/integration/test_feeds.py::test_tasks_and_an_actor_feed_one_epoch_exactly
  tests/integration/test_feeds.py::test_a_killed_producer_fails_the_attempt_and_a_new_feed_is_exact
  # the Ray Data datasink; a failed write task
  tests/integration/test_datasink.py::test_a_dataset_is_one_epoch_and_a_rerun_is_skipped
  tests/integration/test_datasink.py::test_a_failed_write_aborts_the_epoch
  # streams of producer actors; a restarted producer
  tests/integration/test_stream.py::test_producers_stream_epochs_that_commit_on_their_own
  tests/integration/test_stream.py::test_a_restarted_producer_rewinds_the_stream_and_nothing_is_lost_or_doubled
  # schema evolution on every sink
  tests/integration/test_schema_runtime.py
)
KAFKA=(
  tests/kafka/test_kafka_sink.py::test_epochs_exactly_once
  tests/kafka/test_kafka_faults.py::test_writers_and_coordinator_killed
)
SPARK=(
  # write(df): every type through Spark; a writer killed mid-epoch
  tests/spark/test_spark_write.py::test_every_type_round_trips_through_spark
  tests/spark/test_spark_write.py::test_writer_killed_mid_epoch_is_refed
  # foreach_batch of a stream
  tests/spark/test_spark_write.py::test_foreach_batch_adding_a_column
)
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -m "not kafka_cluster")

failed=()
phase() {  # name, then pytest arguments; a failed phase is named at the end, the rest run
  local name=$1 t0 rc=0
  shift
  t0=$(date +%s)
  echo "compat: $name"
  nice -n 5 "${PYTEST[@]}" "$@" || rc=$?
  echo "compat: $name took $(( $(date +%s) - t0 )) s (exit $rc)"
  [ "$rc" -eq 0 ] || failed+=("$name")
}
[ -n "${COMPAT_SKIP_UNIT:-}" ] || phase unit -m unit -n 2 --dist loadfile tests/unit
phase integration -n 2 --dist loadfile "${INTEGRATION[@]}"
phase kafka "${KAFKA[@]}"
# the Spark packages of this pyspark (spark-sql-kafka is of each Spark release) into the
# cache before the spark cases, as `make setup` does for the newest: a no-op once there
nice -n 5 "$PY" scripts/fetch_spark_packages.py
phase spark "${SPARK[@]}"
phase package -m slow tests/package/test_wheel.py
echo "compat: $(( $(date +%s) - started )) s in all (venv $VENV)"
if [ ${#failed[@]} -gt 0 ]; then
  echo "compat: FAILED on the oldest versions: ${failed[*]}" >&2
  exit 1
fi
