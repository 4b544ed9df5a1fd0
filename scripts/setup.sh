#!/usr/bin/env bash
# Set up what raysink's demo and tests need on a fresh machine: a virtual environment with
# the package and its extras, Java 17+ for RayDP, PostgreSQL server binaries and Prometheus
# (with promtool) for the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

need_apt=()
java_major() { java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1; }
if ! command -v java >/dev/null 2>&1 || [ "$(java_major)" -lt 17 ] 2>/dev/null; then
  need_apt+=(openjdk-17-jre-headless)
fi
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need_apt+=(postgresql)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_apt[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: please install ${need_apt[*]} (needed by RayDP / the PostgreSQL tests)" >&2
  fi
fi

# Prometheus for the dashboard test; without recommends (no node exporter service).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing prometheus with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      prometheus >/dev/null
  else
    echo "setup: please install prometheus and promtool (needed by the dashboard test)" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.raysink-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing raysink with its extras into $VENV (a few minutes on a fresh machine)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[dev]"
  touch "$stamp"
fi

# The Kafka broker the Kafka tests start (jars from Maven Central, cached outside git).
if ! command -v mvn >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing maven with apt-get (fetches the Kafka broker for the tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq maven >/dev/null
  fi
fi
bash scripts/kafka/fetch.sh >/dev/null

# The Spark packages (Delta's, Iceberg's connectors...) the spark tests load, from Maven
# Central into raysink's cache (~/.cache/raysink/ivy); a no-op once they are there.
"$VENV/bin/python" scripts/fetch_spark_packages.py

# Bytecode of the project's own modules (an editable install has none): with
# PYTHONDONTWRITEBYTECODE set, as on this kind of machine, every Ray worker would compile
# raysink from source again at each start. Quick, and a no-op for files already compiled.
"$VENV/bin/python" -m compileall -q raysink tests bench examples >/dev/null
