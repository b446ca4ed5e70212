"""Bootstrap intervals (hybridkv_cli.runs.stats): known cases, determinism, the paired difference."""

from __future__ import annotations

import pytest

from hybridkv_cli.runs.stats import bootstrap_ci, paired_diff_ci


def test_constant_values_give_a_zero_width_interval_at_the_value():
    assert bootstrap_ci([0.7] * 25) == (0.7, 0.7)
    assert bootstrap_ci([1.0]) == (1.0, 1.0)
    assert bootstrap_ci([True] * 10) == (1.0, 1.0)


def test_none_when_there_is_nothing_to_resample():
    assert bootstrap_ci([]) is None
    assert bootstrap_ci([None, None]) is None
    assert paired_diff_ci([], []) is None
    assert paired_diff_ci([1.0, None], [None, 0.0]) is None


def test_half_of_100_binary_items():
    values = [1] * 50 + [0] * 50  # p = 0.5, n = 100: the normal approximation gives 0.5 ± 0.098
    lo, hi = bootstrap_ci(values)
    assert 0.38 <= lo <= 0.42 and 0.58 <= hi <= 0.62
    assert lo < 0.5 < hi


def test_the_interval_narrows_with_more_items_and_widens_with_the_level():
    small = bootstrap_ci([1, 0] * 10)
    large = bootstrap_ci([1, 0] * 200)
    assert small[1] - small[0] > 2 * (large[1] - large[0])
    ci90, ci99 = bootstrap_ci([1, 0] * 20, level=0.90), bootstrap_ci([1, 0] * 20, level=0.99)
    assert ci99[0] < ci90[0] and ci99[1] > ci90[1]


def test_none_values_are_skipped():
    assert bootstrap_ci([1, 0, None] * 20) == bootstrap_ci([1, 0] * 20)


def test_deterministic_with_a_seed():
    values = [0.1, 0.9, 0.4, 0.35, 0.8, 0.05, 0.6]
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    assert bootstrap_ci(values, seed=3) != bootstrap_ci(values, seed=4)
    assert paired_diff_ci(values, values[::-1], seed=1) == paired_diff_ci(values, values[::-1], seed=1)


def test_large_samples_are_resampled_in_chunks():
    values = [1.0, 0.0] * 5000  # 10k items x 2000 resamples: more than one chunk
    lo, hi = bootstrap_ci(values, resamples=300)
    assert 0.485 < lo < 0.5 < hi < 0.515


def test_paired_difference():
    a = [1, 0, 1, 1, 0, 1, 0, 1]
    assert paired_diff_ci(a, a) == (0.0, 0.0)
    assert paired_diff_ci([1] * 30, [0] * 30) == (1.0, 1.0)
    # a beats b on 40 of 50 items and ties on the rest: the interval excludes zero
    lo, hi = paired_diff_ci([1] * 50, [0] * 40 + [1] * 10)
    assert 0 < lo < 0.8 < hi <= 1.0
    # b ahead: the interval is the mirror image
    assert paired_diff_ci([0] * 40 + [1] * 10, [1] * 50) == pytest.approx((-hi, -lo))


def test_paired_difference_cancels_the_shared_item_effect():
    # both methods see the same item difficulties; b is 0.05 behind on every item
    a = [0.2, 0.9, 0.5, 0.1, 0.95, 0.3, 0.7, 0.6, 0.15, 0.85] * 3
    b = [x - 0.05 for x in a]
    lo, hi = paired_diff_ci(a, b)
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    unpaired_a, unpaired_b = bootstrap_ci(a), bootstrap_ci(b)
    assert unpaired_a[0] < unpaired_b[1]  # the two single intervals overlap


def test_bad_arguments():
    with pytest.raises(ValueError, match="same length"):
        paired_diff_ci([1, 2], [1])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci([1.0], level=1.0)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_ci([1.0], resamples=0)
