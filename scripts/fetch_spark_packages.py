"""Resolve the Spark packages the spark tests load (``tests/spark/packages.py``) into
raysink's cache, so that no test downloads. Idempotent: a set resolved before is only
looked up. Run by ``scripts/setup.sh``; a failure (Maven Central unreachable) is reported
and leaves setup going: the tests then resolve on first use, and say what failed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysink.errors import ConfigError
from raysink.spark.packages import default_ivy_home, parse_packages, resolve_packages
from tests.spark.packages import SETS


def main() -> int:
    for packages in SETS:
        started = time.monotonic()
        try:
            jars = resolve_packages(parse_packages(packages))
        except ConfigError as exc:
            print(f"setup: Spark packages not fetched (the tests will try again): {exc}",
                  file=sys.stderr)
            return 0
        print(f"setup: Spark packages {', '.join(packages)}: {len(jars)} jars in "
              f"{default_ivy_home()} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
