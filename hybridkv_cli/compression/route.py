"""``route``: a method per layer, read from a route file, under one budget for the whole model.

Layers differ in how they attend and in how much they lose when compressed, so the eviction
method itself may vary by layer (layer-wise routing; see docs/methods.md for what is taken from
the idea and what is this project's design). A route file is JSON::

    {"layers": ["hybridkv", "snapkv", ...], "options": {"hybridkv": {"theta": 0.9}, ...}}

with one registered method per text layer (``route`` itself, ``full`` and ``quest`` excluded: they
keep a layer's whole prompt on the device, outside the one budget) and, optionally, options per
method. ``route`` may also be a comma-separated pattern of methods, repeated over the layers
(``"hybridkv,snapkv"``: even layers hybridkv, odd ones snapkv). Every layer runs its method at
the same budget, so the model keeps ``b`` of its cache as a whole. ``hybridkv route`` builds such
a file from an offline profile (:mod:`hybridkv_cli.runs.routing`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridkv_cli.compression.base import Compressed, Policy, PrefillLayer
from hybridkv_cli.compression.registry import METHODS, make_policy, register
from hybridkv_cli.io.errors import UsageError


def read_route(path: str | list[str]) -> tuple[list[str], dict[str, dict], bool]:
    """(methods, options per method, whether the methods are a pattern to repeat) of a route file
    or a pattern; a UsageError naming the file. A list is the route builder's single-layer profile
    (the other layers ``full``), taken as given. The file is read as every user text file is
    (:mod:`hybridkv_cli.io.user_files`: a regular file, at most 1 MiB) and its options get the checks
    the command line's flags get (:mod:`hybridkv_cli.compression.option_values`)."""
    from hybridkv_cli.io.user_files import read_json

    if isinstance(path, list):
        return path, {}, False
    names = path.split(",")
    if not os.path.lexists(path) and ("," in path or path in METHODS):  # a pattern, not a file
        _check(names, path)
        return names, {}, True
    data = read_json(path, "--route", ROUTE_FORMAT)
    layers = data.get("layers") if isinstance(data, dict) else None
    options = data.get("options", {}) if isinstance(data, dict) else None
    if not isinstance(layers, list) or not layers or not isinstance(options, dict):
        raise UsageError(f"expected {ROUTE_FORMAT}", path)
    _check(layers, path)
    _check_options(options, path)
    return layers, options, False


ROUTE_FORMAT = '{"layers": [method per layer], "options": {method: {option: value}}}'


def _check_options(options: dict, path: str) -> None:
    """A route file's options: per registered method, the options it takes (``budget`` excepted:
    the route's one budget is ``--budget``), each value checked as its flag's is."""
    from hybridkv_cli.compression.option_values import check_option

    for name, given in options.items():
        if name not in METHODS or name == "route":
            raise UsageError(f"options: unknown method {name!r} (available: {', '.join(sorted(set(METHODS) - {'route'}))})",
                             path)
        if not isinstance(given, dict):
            raise UsageError(f"options.{name}: expected an object {{option: value}}", path)
        for key, value in given.items():
            if key == "budget":
                raise UsageError(f"options.{name}.budget: a route has one budget for the whole model (--budget)", path)
            if key not in METHODS[name].options():
                raise UsageError(f"options.{name}: {key!r} is not an option of {name}", path)
            try:
                check_option(key, value)
            except UsageError as e:
                raise UsageError(f"options.{name}.{key}: {e.reason}", path) from None


# Every layer of a route keeps b of its cache; these keep the whole prompt on the device.
UNROUTABLE = {"full": "keeps the layer's whole cache", "quest": "keeps the whole prompt on the device (it saves reads)"}


def refusal(name) -> str | None:
    """Why a route may not name method ``name``; None if it may."""
    if name in UNROUTABLE:
        return f"'{name}' {UNROUTABLE[name]}, which breaks the route's one budget for the whole model"
    if name not in METHODS or name == "route":
        available = sorted(set(METHODS) - {"route", *UNROUTABLE})
        return f"unknown method '{name}' in the route (available: {', '.join(available)})"
    return None


def _check(layers: list, path: str) -> None:
    for index, name in enumerate(layers):
        if not isinstance(name, str):
            raise UsageError(f"layer {index}: expected a method name, got {type(name).__name__}", path)
        if reason := refusal(name):
            raise UsageError(f"layer {index}: {reason}", path)


@register("route")
@dataclass
class Route(Policy):
    """Layer-wise routing: each layer compressed by the method a route file names for it.

    Parameters
    ----------
    route : str or list of str
        The route file (JSON, see the module docstring), or a pattern of methods; a list is the
        route builder's single-layer profile.
    """

    route: str | list[str] | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.route is None:
            raise UsageError("the route method needs a route file (--route FILE; `hybridkv route` builds one)",
                             "--route")
        self._layers, options, self._repeat = read_route(self.route)
        budgeted = {name: {} if name == "full" else {"budget": self.budget} for name in set(self._layers)}
        try:
            self._policies = {name: make_policy(name, **budgeted[name], **options.get(name, {}))
                              for name in budgeted}
        except UsageError as e:
            raise UsageError(f"route options: {e.reason}", self.route) from None

    def compress(self, layer: PrefillLayer) -> Compressed:
        if not self._repeat and len(self._layers) != layer.num_layers:
            raise UsageError(f"names methods for {len(self._layers)} layers, the model has {layer.num_layers}",
                             self.route)
        name = self._layers[layer.index % len(self._layers)]
        kv, report = self._policies[name].compress(layer)
        return Compressed(kv, (name, report))

    def summary(self, reports: list) -> dict:
        by_method: dict[str, list] = {}
        for name, report in reports:
            by_method.setdefault(name, []).append(report)
        return {
            "route": self.route,
            "per_layer": [name for name, _ in reports],
            "methods": {name: self._policies[name].summary(rs) for name, rs in by_method.items()},
        }
