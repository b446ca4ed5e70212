"""The method registry: ``--method NAME`` -> its policy class, and :func:`make_policy`.

The methods import :func:`register` from here; :mod:`hybridkv_cli.compression` imports them after
this module, so the registry fills with no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hybridkv_cli.compression.base import Policy
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.compression.option_values import check_options

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


@dataclass(frozen=True)
class MethodOptions:
    """The method options a run was given, typed; None: not given (each method's default).

    The fields are every option some registered method takes (the union of the policies'
    fields, tested), so the command line, a session and the lmms-eval model carry one object
    instead of a dict; :meth:`policy` builds a method from it, refusing an option it does not take.
    """

    budget: float | None = None
    window: int | None = None
    theta: float | None = None
    sparsity_topk: float | None = None
    share: float | None = None
    chunk_size: int | None = None
    sink_aware: bool | None = None
    landmark: str | None = None
    index_file: str | None = None
    refresh: str | None = None
    refresh_rate: float | None = None
    refresh_period: int | None = None
    refresh_slots: int | None = None
    swaps: int | None = None
    stickiness: float | None = None
    sinks: int | None = None
    page_size: int | None = None
    head_scores: str | None = None
    route: str | None = None
    alpha: float | None = None  # hybridkv and sparsemm options with no command-line flag
    min_share: float | None = None

    @classmethod
    def of(cls, values: dict) -> "MethodOptions":
        """From a mapping of option names (the lmms-eval model's arguments): an unknown name is a
        usage error naming it."""
        known = {f.name for f in fields(cls)}
        for name in values:
            if name not in known:
                raise UsageError("is not an option of any method", name)
        return cls(**values)

    def given(self) -> dict:
        """The options given, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def policy(self, method: str, **overrides) -> Policy:
        """``method`` built from these options (``overrides`` win: a sweep's budget)."""
        return make_policy(method, **{**self.given(), **overrides})

    def per_method(self, methods: list[str]) -> dict[str, dict]:
        """Per method, the given options it takes (``bench``: each option goes to every method that
        takes it); one none of ``methods`` takes, or a value a method refuses, is a usage error."""
        given = self.given()
        taken = {m: {k: v for k, v in given.items() if k in METHODS[m].options()} for m in methods}
        for option in sorted(given):
            if not any(option in kw for kw in taken.values()):
                raise UsageError(f"does not apply to any of the methods {', '.join(methods)}",
                                 "--" + option.replace("_", "-"))
        for method, kw in taken.items():
            make_policy(method, **kw)  # refuses bad values before any input runs
        return taken
