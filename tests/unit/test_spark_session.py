"""``raysink.spark.stop_spark`` leaves Ctrl-C as it found it.

PySpark's ``SparkContext`` installs a SIGINT handler that cancels the context's jobs and
leaves it in place after the context stopped; Ctrl-C then raised ``AttributeError:
'NoneType' object has no attribute 'sc'`` (seen in a chaos run stopped with Ctrl-C after
its Spark session had ended). RayDP is replaced here by a stand-in that installs such a
handler, as PySpark does: starting and stopping a real session is the Spark layer's.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from raysink.spark import session


class _StoppedContext:
    _jsc = None

    def cancel_all_jobs(self) -> None:
        self._jsc.sc()  # type: ignore[attr-defined]  # what PySpark does, stopped


def _pyspark_like_init(*args: Any, **kwargs: Any) -> Any:
    context = _StoppedContext()

    def handler(signum: int, frame: object) -> None:
        context.cancel_all_jobs()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    return object()


def test_stop_spark_puts_back_the_sigint_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    import raydp

    monkeypatch.setattr(raydp, "init_spark", _pyspark_like_init)
    monkeypatch.setattr(raydp, "stop_spark", lambda: None)
    monkeypatch.setattr(session, "_ensure_ray", lambda cpus: None)
    monkeypatch.setattr(session, "check_java", lambda: None)
    before = signal.getsignal(signal.SIGINT)
    try:
        session.init_spark("sigint", executors=1)
        assert signal.getsignal(signal.SIGINT) is not before  # PySpark's, while it runs
        session.stop_spark()
        assert signal.getsignal(signal.SIGINT) is before
        session.stop_spark()  # again: harmless
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, before)
        monkeypatch.setattr(session, "_session", None)
