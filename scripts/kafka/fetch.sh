#!/usr/bin/env bash
# Fetch the Apache Kafka broker the tests run (scripts/kafka/pom.xml) from Maven Central
# into ~/.cache/raysink/kafka-<version>/ (RAYSINK_KAFKA_HOME overrides it). Idempotent:
# skipped when the cache holds the jars already. Prints the directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version=$(sed -n 's#.*<kafka.version>\(.*\)</kafka.version>.*#\1#p' "$here/pom.xml")
dest="${RAYSINK_KAFKA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/raysink/kafka-$version}"
if [ -f "$dest/.complete" ]; then
  echo "$dest"
  exit 0
fi
if ! command -v mvn >/dev/null 2>&1; then
  echo "kafka: Maven (mvn) is needed to fetch the broker's jars; install it (apt-get install maven)" >&2
  exit 1
fi
mkdir -p "$(dirname "$dest")"
tmp="$(mktemp -d "$(dirname "$dest")/.kafka-$version.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
echo "kafka: fetching the Kafka $version broker's jars from Maven Central into $dest" >&2
mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$tmp" >&2
touch "$tmp/.complete"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
echo "$dest"
