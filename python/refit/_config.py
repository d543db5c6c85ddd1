"""The configuration file a Publisher or a Receiver may start from, and how keywords override it."""

from __future__ import annotations

import numbers
import os
from typing import Any, List, Mapping, Optional, Tuple

from . import _core

#: A refit configuration file (the YAML ``refit push`` and ``refit serve`` read):
#: ``Config.load(path)`` or ``Config.parse(text)``. Pass it as ``config=`` to a Publisher or a
#: Receiver; explicit keyword arguments override what it says.
Config = _core.Config


def _text(value: Any) -> Any:
    """A keyword's value as the configuration file would spell it (numpy scalars included)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_text(element) if not isinstance(element, tuple) else element for element in value]
    return value


def overrides(owner: str, keys: Mapping[str, str], given: Mapping[str, Any]) -> List[Tuple[str, Any, str]]:
    """The keywords of ``keys`` that ``given`` (a constructor's ``locals()``) sets, as (key path,
    value, origin).

    ``keys`` maps each keyword to the configuration key it sets: with the signature, the only
    places a keyword is spelled. A keyword left at None keeps the file's value (or the default);
    the C++ configuration layer reads and checks a given one as the file's own key, and names
    ``owner(keyword=)`` in its errors.
    """
    return [
        (key, _text(given[keyword]), f"{owner}({keyword}=)")
        for keyword, key in keys.items()
        if given.get(keyword) is not None
    ]
