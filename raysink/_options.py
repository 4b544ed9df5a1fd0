"""Constructors that answer a misspelt or unknown option with ``ConfigError``.

Python's own answer, ``TypeError: __init__() got an unexpected keyword argument``, names
neither the class's options nor the one that was meant. ``checked_options`` wraps an
``__init__`` so that any call it cannot bind raises ``ConfigError`` saying which option is
unknown, the closest known one, and the whole list::

    ConfigError: DeltaSink has no option 'partiton_by' (did you mean 'partition_by'?);
    its options are: path, partition_by, mode, key, ...

``Sink`` subclasses get it automatically (``Sink.__init_subclass__``); ``SinkRuntime``
uses the decorator ``rejects_unknown_options``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from raysink.errors import ConfigError

__all__ = ["checked_options", "rejects_unknown_options"]

F = TypeVar("F", bound=Callable[..., None])

_CHECKED = "__raysink_checked_options__"


def checked_options(owner: str, init: F) -> F:
    """``init`` (an ``__init__``), raising ``ConfigError`` for arguments it cannot take."""
    if getattr(init, _CHECKED, False):
        return init
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise ConfigError(_explain(owner, signature, args, kwargs, exc)) from None
        init(self, *args, **kwargs)

    setattr(wrapper, _CHECKED, True)
    return wrapper  # type: ignore[return-value]


def rejects_unknown_options(owner: str) -> Callable[[F], F]:
    """``checked_options`` as a decorator of an ``__init__``."""
    return functools.partial(checked_options, owner)


def _explain(owner: str, signature: inspect.Signature, args: tuple[Any, ...],
             kwargs: dict[str, Any], exc: TypeError) -> str:
    params = [p for name, p in signature.parameters.items() if name != "self"]
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [k for k in kwargs if k not in names]
    listing = f"its options are: {', '.join(names)}"
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{owner} has no option {name!r}{hint}; {listing}"
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(positional):
        return (f"{owner} takes {len(positional)} positional argument(s) "
                f"({', '.join(positional) or 'none'}); pass the others by name; {listing}")
    return f"{owner}: {exc}; {listing}"
