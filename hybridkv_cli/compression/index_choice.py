"""``--landmark auto``: the ranking index of a layer, by modelled step time among those that keep
the answers at its budget, and the one rule for which heads are pruned once.

Quality first (the dev splits, docs/quality.md): an index is admissible at a budget where it
kept at least 90 % of the full cache's answers there, the question answered and deferred —

* ``keys`` (2-bit keys on the device) while they cost at most half of the budget. Over half, the
  retrieved tokens are too few for a question read after compression: in bf16 at b = 0.1 (the
  keys 5/8 of the budget, every head dynamic) they answer 16 of 26 dev rows with the question
  (full cache 18) but 10 of 23 with it deferred (full 16), where host keys answer 15 of 26 (full 18);
* ``host-keys`` at every budget (at b = 0.05 in bf16 19 of 19 of the full cache's answers);
* not ``labels`` (61–83 % of the full cache at b = 0.05–0.1) nor chunk ``mean`` keys (7 of 26
  where 2-bit keys answer 20).

Then time: each admissible index is priced by the step model (:mod:`hybridkv_cli.costs`) on the
run's device profile, and the cheapest wins; on a tie (a CPU, where host and device are one
memory) the first in :data:`ORDER`. Device keys read from HBM what host keys read over the host
link, so they win wherever both are admissible.
"""

from __future__ import annotations

from fractions import Fraction

from hybridkv_cli.costs.profiles import DeviceProfile
from hybridkv_cli.costs.step_model import Geometry, method_traffic, step_ms

ORDER = ("keys", "host-keys")
KEYS_MAX_SHARE = Fraction(1, 2)  # of the budget, where 2-bit keys on the device still keep the answers
MISS_SHARE = 0.1  # slots a step replaces, to price the gather (the same for every index: no effect on the order)


def keys_share(element_size: int) -> float:
    """2-bit keys as a share of the KV: ``d/4`` bytes a token against its key and value, ``2·d·size``."""
    return 1 / (8 * element_size)


def every_head_dynamic(fraction: float, element_size: int) -> bool:
    """The one rule, whatever the index: where 2-bit keys would cost over half of the budget, a
    one-shot selection keeps too little of the prompt (at b = 0.05 in bf16, 16 dev answers with
    the heads classified, 19 with every head dynamic), so no head is pruned once."""
    return keys_share(element_size) > fraction / 2


def admissible(index: str, fraction: float, element_size: int) -> bool:
    if index == "keys":
        return keys_share(element_size) <= float(KEYS_MAX_SHARE) * fraction
    return index == "host-keys"


def choose_index(fraction: float, length: int, heads: int, dim: int, element_size: int,
                 profile: DeviceProfile) -> tuple[str, str]:
    """``(index, reason)`` for one layer of ``heads`` KV heads over ``length`` prompt tokens."""
    layer = Geometry("layer", layers=1, kv_heads=heads, head_dim=dim, dtype_bytes=element_size, weight_bytes=0)
    timed = [(step_ms(profile, layer, method_traffic(i, layer, length, fraction, miss_share=MISS_SHARE)), i)
             for i in ORDER if admissible(i, fraction, element_size)]
    ms, index = min(timed, key=lambda t: (t[0], ORDER.index(t[1])))
    share = keys_share(element_size)
    if index == "keys":
        reason = (f"2-bit keys on the device cost {share:.4g} of the KV, within {KEYS_MAX_SHARE} of the budget "
                  f"{fraction:g} where they keep the answers; read from device memory, the fastest such index "
                  f"on {profile.name}")
    else:
        reason = (f"2-bit keys on the device would cost {share:.4g} of the KV, over {KEYS_MAX_SHARE} of the budget "
                  f"{fraction:g}: in host memory they are the only index that keeps the answers, read over the "
                  f"host link every step")
    if every_head_dynamic(fraction, element_size):
        reason += "; every head dynamic (the keys would cost over half the budget)"
    return index, reason
