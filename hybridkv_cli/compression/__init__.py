"""Compression methods behind one registry: ``make_policy("hybridkv", budget=0.1)``."""

from __future__ import annotations

from hybridkv_cli.compression.base import Compressed, LayerKV, Policy, PrefillLayer
from hybridkv_cli.compression.registry import METHODS, MethodOptions, make_policy, register

# Importing the method modules registers them.
from hybridkv_cli.compression import (  # noqa: F401
    full, hybridkv, lookm, madakv, quest, rcr, retentivekv, route, snapkv, sparsemm, streamingllm,
)

__all__ = ["METHODS", "Compressed", "LayerKV", "MethodOptions", "Policy", "PrefillLayer", "make_policy", "register"]
