#!/usr/bin/env bash
# Print the path of the compat venv: the oldest release of every dependency range
# (constraints/oldest.txt) and the test tools (constraints/test-tools.txt), built once per
# content of those files and Python version under ~/.cache/raysink, so a clean clone in CI
# builds it once and later runs reuse it. The build goes through pyproject's own ranges
# (`pip install -c constraints/oldest.txt '.[all]'`): a floor outside a range fails here.
# raysink itself is uninstalled again: the tests import the clone's source (PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
key=$( { grep -hv '^#' constraints/oldest.txt constraints/test-tools.txt
        "$PYTHON" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
VENV=${COMPAT_VENV:-$HOME/.cache/raysink/compat-venv-$key}
if [ ! -f "$VENV/.raysink-complete" ]; then
  echo "compat: building $VENV (the oldest versions; a few minutes, once)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q -c constraints/oldest.txt -r constraints/test-tools.txt \
    '.[all]' >&2
  "$VENV/bin/python" -m pip uninstall -q -y raysink >&2
  "$VENV/bin/python" -m pip check >&2
  touch "$VENV/.raysink-complete"
fi
echo "$VENV"
