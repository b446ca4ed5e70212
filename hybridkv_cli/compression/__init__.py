"""Compression methods behind one registry: ``make_policy("hybridkv", budget=0.1)``."""

from __future__ import annotations

from hybridkv_cli.compression.base import Compressed, LayerKV, Policy, PrefillLayer
from hybridkv_cli.errors import UsageError
from hybridkv_cli.option_values import check_options

METHODS: dict[str, type[Policy]] = {}


def register(name: str):
    """Class decorator: make a policy selectable as ``--method name``."""

    def wrap(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        METHODS[name] = cls
        return cls

    return wrap


def make_policy(name: str, **options) -> Policy:
    """Instantiate a registered method from its options; an option left as None takes the
    method's default, one the method does not take is refused (a usage error naming its flag)."""
    if name not in METHODS:
        raise UsageError(f"unknown method '{name}' (available: {', '.join(sorted(METHODS))})", "--method")
    cls = METHODS[name]
    given = {k: v for k, v in options.items() if v is not None}
    refused = sorted(given.keys() - set(cls.options()))
    if refused:
        raise UsageError(f"does not apply to method '{name}'", "--" + refused[0].replace("_", "-"))
    check_options(given)  # the one check of each value, from the command line, a route file or the library
    return cls(**given)


# Importing the method modules registers them.
from hybridkv_cli.compression import (  # noqa: E402,F401
    full, hybridkv, lookm, madakv, quest, rcr, retentivekv, route, snapkv, sparsemm, streamingllm,
)

__all__ = ["METHODS", "Compressed", "LayerKV", "Policy", "PrefillLayer", "make_policy", "register"]
