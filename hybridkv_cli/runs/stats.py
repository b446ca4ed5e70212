"""Bootstrap confidence intervals for the means ``hybridkv bench`` reports.

A benchmark of a few dozen items gives accuracies whose sampling error is several points wide;
these intervals say how wide. Both functions are percentile bootstraps over items (resample the
items with replacement, take the mean, read the interval off the quantiles of those means),
deterministic for a given ``seed``.

* :func:`bootstrap_ci`: the interval of one mean (an accuracy over 0/1 items, a mean fidelity).
* :func:`paired_diff_ci`: the interval of ``mean(a - b)`` over paired items (two methods on the
  same inputs): "X beats Y" holds at the given level when the interval lies above zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

#: Resample this many (resample, item) cells at a time: bounds the memory of a large sample.
_CELLS_PER_CHUNK = 1 << 20


def _check(resamples: int, level: float) -> None:
    if not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be a positive integer, got {resamples!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1 (exclusive), got {level!r}")


def _percentile_interval(values: np.ndarray, resamples: int, seed: int, level: float) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    n = len(values)
    means = np.empty(resamples)
    step = max(1, _CELLS_PER_CHUNK // n)
    for start in range(0, resamples, step):
        stop = min(resamples, start + step)
        means[start:stop] = values[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    # a resampled mean lies within the sample's range: clipping only removes rounding (a constant
    # sample then gives exactly that constant at both ends)
    return float(np.clip(lo, values.min(), values.max())), float(np.clip(hi, values.min(), values.max()))


def bootstrap_ci(values: Iterable[float | bool | None], *, resamples: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap confidence interval of the mean of ``values``.

    Parameters
    ----------
    values : iterable of float, bool or None
        The per-item values (booleans count as 0/1). ``None`` entries are skipped, as the
        benchmark's means skip items without a value.
    resamples : int, optional
        Number of bootstrap resamples (default 2000).
    seed : int, optional
        Seed of the random generator (default 0): the same inputs give the same interval.
    level : float, optional
        Coverage of the interval, strictly between 0 and 1 (default 0.95).

    Returns
    -------
    tuple of float or None
        ``(lo, hi)``, the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled
        means; ``None`` when there is no value.

    Raises
    ------
    ValueError
        If ``resamples`` is not a positive integer or ``level`` is not in (0, 1).

    Examples
    --------
    >>> bootstrap_ci([0.5, 0.5, 0.5])
    (0.5, 0.5)
    >>> bootstrap_ci([]) is None
    True
    """
    _check(resamples, level)
    kept = np.array([float(v) for v in values if v is not None], dtype=float)
    if kept.size == 0:
        return None
    return _percentile_interval(kept, resamples, seed, level)


def paired_diff_ci(a: Iterable[float | bool | None], b: Iterable[float | bool | None], *, resamples: int = 2000,
                   seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap confidence interval of ``mean(a - b)`` over paired items.

    The items are resampled as pairs, so what the two share (the same input, hard for both)
    cancels: the interval is narrower than one built from two independent intervals.

    Parameters
    ----------
    a, b : iterables of float, bool or None
        The per-item values of the two contenders, item ``i`` of ``a`` paired with item ``i``
        of ``b`` (booleans count as 0/1). A pair with ``None`` on either side is skipped.
    resamples, seed, level
        As for :func:`bootstrap_ci`.

    Returns
    -------
    tuple of float or None
        ``(lo, hi)`` of the mean difference ``a - b``; ``None`` when no pair is complete. An
        interval with ``lo > 0`` says ``a`` is ahead at the given level.

    Raises
    ------
    ValueError
        If ``a`` and ``b`` differ in length, or as for :func:`bootstrap_ci`.

    Examples
    --------
    >>> paired_diff_ci([1, 0, 1], [1, 0, 1])
    (0.0, 0.0)
    """
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise ValueError(f"paired samples must have the same length, got {len(a)} and {len(b)}")
    return bootstrap_ci([float(x) - float(y) for x, y in zip(a, b) if x is not None and y is not None],
                        resamples=resamples, seed=seed, level=level)
