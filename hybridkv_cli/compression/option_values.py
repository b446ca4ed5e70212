"""The one check of every method option's value, wherever the value comes from: the command line
(``--window``), a route file's ``options`` or the library (``make_policy("snapkv", window=-5)``).

:func:`check_option` raises a :class:`~hybridkv_cli.io.errors.UsageError` naming the option's flag
(``--window``); callers that read the value from a file re-raise it naming the file and key.
"""

from __future__ import annotations

import math
import os

from hybridkv_cli.io.errors import UsageError

#: The largest integer option value (counts of tokens, slots, steps): a 32-bit signed int.
MAX_INT = 2**31 - 1


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _number(name: str, value, integer: bool) -> None:
    what = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int):
        raise UsageError(f"must be {what}, got {_shown(value)}", flag(name))
    if not integer and not math.isfinite(value):
        raise UsageError(f"must be a finite number, got {value}", flag(name))


def _shown(value) -> str:
    text = repr(value) if isinstance(value, str) else type(value).__name__ if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_in(low: int, high: int = MAX_INT):
    def check(name, value):
        _number(name, value, True)
        if not low <= value <= high:
            raise UsageError(f"must be an integer in [{low}, {high}], got {_shown(value)}", flag(name))
    return check


def _float_in(low: float, high: float, low_open: bool = False):
    def check(name, value):
        _number(name, value, False)
        if not (low < value if low_open else low <= value) or value > high:
            span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise UsageError(f"must be in {span}, got {value:g}", flag(name))
    return check


def _choice_text(name, value):
    if not isinstance(value, str):
        raise UsageError(f"must be a string, got {_shown(value)}", flag(name))


def _bool(name, value):
    if not isinstance(value, bool):
        raise UsageError(f"must be true or false, got {_shown(value)}", flag(name))


def _path(name, value):
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise UsageError(f"must be a file name, got {_shown(value)}", flag(name))


def _route(name, value):
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return
    if not isinstance(value, str) or not value:
        raise UsageError(f"must be a route file or a pattern of methods, got {_shown(value)}", flag(name))


def _budget(name, value):
    from hybridkv_cli.compression.base import check_budget

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"must be a number, got {_shown(value)}", flag(name))
    check_budget(value, flag(name))


#: option -> its check (the value's type and range). The choices of ``landmark`` and ``refresh``
#: are the methods' own (``check_choice``); here only their type.
CHECKS = {
    "budget": _budget,
    "window": _int_in(1),
    "theta": _float_in(0.0, 1.0),
    "sparsity_topk": _float_in(0.0, 1.0, low_open=True),
    "share": _float_in(0.0, 1000.0, low_open=True),
    "chunk_size": _int_in(1),
    "sink_aware": _bool,
    "landmark": _choice_text,
    "index_file": _path,
    "refresh": _choice_text,
    "refresh_rate": _float_in(0.0, 1.0),
    "refresh_period": _int_in(1),
    "refresh_slots": _int_in(1),
    "swaps": _int_in(0),
    "stickiness": _float_in(0.0, 100.0),
    "sinks": _int_in(0),
    "page_size": _int_in(1),
    "head_scores": _path,
    "route": _route,
    "alpha": _float_in(0.0, 1.0),
    "min_share": _float_in(0.0, 1.0),
}


def check_option(name: str, value) -> None:
    """Refuse a bad ``value`` of method option ``name`` (a UsageError naming its flag); None
    (the method's default) and options without a check pass."""
    if value is not None and name in CHECKS:
        CHECKS[name](name, value)


def check_options(options: dict) -> None:
    for name, value in options.items():
        check_option(name, value)
