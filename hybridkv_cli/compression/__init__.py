"""Compression methods behind one registry: ``make_policy("hybridkv", budget=0.1)``."""

from __future__ import annotations

from hybridkv_cli.compression.base import LayerKV, Policy, PrefillLayer
from hybridkv_cli.errors import UsageError

METHODS: dict[str, type[Policy]] = {}


def register(name: str):
    """Class decorator: make a policy selectable as ``--method name``."""

    def wrap(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        METHODS[name] = cls
        return cls

    return wrap


def make_policy(name: str, **options) -> Policy:
    """Instantiate a registered method; options it does not take (or left as None) are ignored."""
    if name not in METHODS:
        raise UsageError(f"unknown method '{name}' (available: {', '.join(sorted(METHODS))})", "--method")
    budget = options.get("budget")
    if budget is not None and not 0 < budget <= 1:
        raise UsageError(f"budget must be in (0, 1], got {budget}", "--budget")
    cls = METHODS[name]
    accepted = set(cls.options())
    return cls(**{k: v for k, v in options.items() if k in accepted and v is not None})


# Importing the method modules registers them.
from hybridkv_cli.compression import (  # noqa: E402,F401
    full, hybridkv, lookm, madakv, quest, rcr, snapkv, sparsemm, streamingllm,
)

__all__ = ["METHODS", "LayerKV", "Policy", "PrefillLayer", "make_policy", "register"]
