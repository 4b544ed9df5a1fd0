#!/usr/bin/env bash
# `make upgrade`: the upgrade test run from this release's wheel, not from the source tree.
#   1. every stored previous release (tests/upgrade/releases) whose tag this clone has is
#      built again from its tag and compared with its stored wheel (a clone without the
#      tags, as CI's, checks the stored wheels by their sha256 only);
#   2. `python -m build` makes this tree's wheel;
#   3. a fresh venv gets `raysink-*.whl[all]`, at the versions this project's venv runs
#      (its `pip freeze` as constraints), and pytest;
#   4. a copy of tests/ (and the Kafka fetch script the broker fixture calls), outside the
#      source tree, runs tests/upgrade with that venv's interpreter and no PYTHONPATH: the
#      new driver and its Ray workers import the installed wheel; each previous release
#      runs from its own environment (tests/upgrade/release.py).
# About 3 minutes to set up (pip's cache warm), then 45-90 s per release and meta store.
# UPGRADE_KEEP=1 keeps the scratch directory; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY="${VENV:-.venv}/bin/python"
WORK=$(mktemp -d /tmp/raysink-upgrade.XXXXXX)
[ -n "${UPGRADE_KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
started=$(date +%s)

echo "upgrade: the stored previous releases"
"$PY" -m tests.upgrade.release check

echo "upgrade: this tree's wheel"
"$PY" -m build --wheel --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log"; exit 1; }
wheel=$(ls "$WORK"/dist/raysink-*.whl)
echo "  $(basename "$wheel")"

echo "upgrade: a fresh venv with the wheel [all]"
"$PY" -m pip freeze --exclude-editable | grep -v -i '^raysink' >"$WORK/constraints.txt"
"$PY" -m venv "$WORK/venv"
NEW="$WORK/venv/bin/python"
env -u PYTHONPATH "$NEW" -m pip install -q --disable-pip-version-check \
  -c "$WORK/constraints.txt" "$wheel[all]" pytest pytest-timeout psutil

mkdir -p "$WORK/suite/scripts"
cp -r tests "$WORK/suite/tests"
cp -r scripts/kafka "$WORK/suite/scripts/kafka"
cp pyproject.toml "$WORK/suite/pyproject.toml"  # the pytest settings and markers
cd "$WORK/suite"
where=$(env -u PYTHONPATH "$NEW" -c 'import raysink; print(raysink.__version__, raysink.__file__)')
echo "  raysink $where"
case "${where#* }" in
  "$WORK/venv/"*) ;;
  *) echo "upgrade: raysink is imported from ${where#* }, not the fresh venv" >&2; exit 1 ;;
esac
echo "upgrade: set up in $(( $(date +%s) - started )) s; the test, from $WORK/suite"
env -u PYTHONPATH -u RAY_ADDRESS "$NEW" -m pytest tests/upgrade -m upgrade \
  -p no:cacheprovider -q "$@"
echo "upgrade: $(( $(date +%s) - started )) s in all"
