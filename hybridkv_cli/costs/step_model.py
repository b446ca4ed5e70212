"""The modelled time of one decode step: bytes per tier, priced by a :class:`DeviceProfile`.

A step of a batch reads the weights once, and for every sequence its device KV and device index
(HBM), the host codes it reads in place (the host link, large reads) and the retrieved rows it
copies (the host link, scattered rows); each kernel costs ``launch_us``. The tiers are summed,
not overlapped: a retrieval's reads sit on the path to the attention that needs them, so the
sum is the honest bound until a GPU measures the overlap.

Which index a HybridKV layer ranks with is the main term (bytes a token a head, for a head
dimension ``d``):

=============  ======================  ==================================================
index          on the device           read every step
=============  ======================  ==================================================
keys           ``d/4`` (2-bit keys)    ``d/4`` a token from HBM
host-keys      each channel's range    ``d/4`` a token over the host link
labels         ``d/16`` (label chans)  ``d/16`` from HBM + ``d/4`` per candidate (4 a slot)
mean           ``(d+4)/16`` (int8)     the same from HBM
=============  ======================  ==================================================

Every index is paid from the budget, so the device store holds what it leaves; a step copies
the slots whose token changed (``miss_share`` of them, measured: see docs/step_model.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv_cli.costs.profiles import DeviceProfile

CANDIDATES = 4  # label-ranked candidates per slot, as compression.landmarks.CANDIDATES
# Share of a dynamic head's slots a step copies in, measured on the 26 text dev rows (SmolLM2, bf16,
# b = 0.1, 2-bit keys on the device, every head dynamic): each step's top-n (the default), and
# with a held token ranked one logit higher (--stickiness 1) (docs/step_model.md).
MISS_SHARE = 0.36
MISS_SHARE_STICKY = 0.24
MEAN_CHUNK = 16  # chunk-mean landmarks at their default chunk
QUEST_PAGE = 8

# Kernels per layer-step beyond the model's own: the KV append and the attention (every method),
# then each method's ranking and gather (the ceilings of the emulated CUDA step,
# tests/test_cuda_path.py; the swap cap runs inside the selection's launch). ``shared`` kernels
# serve a whole batch in one launch; ``per_member`` run once per sequence (the label index's two
# stages rank one sequence at a time; host keys rank a batch in one pass, as device keys do).
KERNELS = {  # method -> (shared, per_member)
    "full": (3, 0), "one-shot": (3, 0), "quest": (6, 0),
    "keys": (7, 0), "mean": (7, 0), "host-keys": (7, 0), "labels": (3, 6),
}


@dataclass(frozen=True)
class Geometry:
    """A model's decode geometry: ``layers`` × ``kv_heads`` heads of ``head_dim`` in ``dtype_bytes``."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    weight_bytes: float  # the language model's weights, read once a step

    @property
    def entry_bytes(self) -> int:
        """One key and one value of one head."""
        return 2 * self.head_dim * self.dtype_bytes

    @property
    def heads(self) -> int:
        return self.layers * self.kv_heads

    def kv_bytes(self, tokens: float) -> float:
        return self.heads * tokens * self.entry_bytes


# Qwen2.5-VL-7B's language model in bf16: 28 layers, 4 KV heads of 128, 7.6 B parameters.
QWEN25_VL_7B = Geometry("qwen2.5-vl-7b", layers=28, kv_heads=4, head_dim=128, dtype_bytes=2, weight_bytes=15.2e9)


@dataclass(frozen=True)
class Traffic:
    """What one sequence moves in one decode step (bytes) and the kernels it adds."""

    hbm: float = 0.0
    link: float = 0.0
    scattered: float = 0.0
    shared_kernels: int = 0  # per layer-step, once for a batch
    member_kernels: int = 0  # per layer-step, per sequence


def index_bytes(index: str, dim: int) -> float:
    """Device bytes a token a head of each ranking index (the table above)."""
    return {"keys": dim / 4, "host-keys": 0.0, "labels": dim / 16, "mean": (dim + 4) / MEAN_CHUNK}[index]


def method_traffic(method: str, geometry: Geometry, tokens: int, budget: float, *, miss_share: float,
                   swaps: int = 0, window: int = 16) -> Traffic:
    """One sequence's step at ``tokens`` prompt tokens and budget ``budget``.

    ``method``: ``full``, ``one-shot`` (SnapKV and the other prune-once methods), ``quest``, or a
    HybridKV index with every head dynamic: ``keys``, ``host-keys``, ``labels``, ``mean``. A step
    copies ``miss_share`` of a head's slots, at most ``swaps`` (2-bit keys with the cap; 0: none).
    """
    g, kv = geometry, geometry.kv_bytes(tokens)
    shared, member = KERNELS[method]
    if method == "full" or budget >= 1:
        return Traffic(hbm=kv, shared_kernels=KERNELS["full"][0])
    if method == "one-shot":
        return Traffic(hbm=budget * kv, shared_kernels=shared)
    if method == "quest":  # the whole cache stays; a step reads the pages' bounds and the chosen pages
        bounds = g.heads * tokens / QUEST_PAGE * 2 * (g.head_dim + 4)
        return Traffic(hbm=bounds + budget * kv, shared_kernels=shared)
    index = g.heads * tokens * index_bytes(method, g.head_dim)
    entries = max(0.0, budget * kv - index) / g.entry_bytes / g.heads  # a head's store rows
    slots = max(0.0, entries - min(window, entries / 4))
    changed = miss_share * slots
    if swaps and method in ("keys", "host-keys"):
        changed = min(changed, swaps)
    copies = changed * g.heads * g.entry_bytes
    codes = g.heads * tokens * g.head_dim / 4  # every token's 2-bit key
    link = codes if method == "host-keys" else 0.0
    candidates = g.heads * min(tokens, CANDIDATES * slots) * g.head_dim / 4 if method == "labels" else 0.0
    return Traffic(hbm=budget * kv, link=link, scattered=copies + candidates, shared_kernels=shared,
                   member_kernels=member)


def step_ms(profile: DeviceProfile, geometry: Geometry, traffic: Traffic, batch: int = 1) -> float:
    """Modelled ms of one step of ``batch`` sequences that each move ``traffic``."""
    seconds = (geometry.weight_bytes + batch * traffic.hbm) / (profile.hbm_gbps * 1e9)
    seconds += batch * traffic.link / (profile.link_gbps * 1e9)
    seconds += batch * traffic.scattered / (profile.link_scattered_gbps * 1e9)
    kernels = geometry.layers * (traffic.shared_kernels + batch * traffic.member_kernels)
    return 1e3 * seconds + kernels * profile.launch_us / 1e3


def roofline_ms(profile: DeviceProfile, geometry: Geometry, tokens: int, budget: float, batch: int = 1) -> float:
    """Weights plus ``budget`` × the full KV from HBM, nothing else: what no KV method beats."""
    return 1e3 * (geometry.weight_bytes + batch * budget * geometry.kv_bytes(tokens)) / (profile.hbm_gbps * 1e9)


def with_dtype(geometry: Geometry, dtype_bytes: int) -> Geometry:
    return replace(geometry, dtype_bytes=dtype_bytes, weight_bytes=geometry.weight_bytes * dtype_bytes / 2)


def run_estimate(profile: DeviceProfile, *, layers: int, weight_bytes: float, device_kv_bytes: float,
                 h2d_bytes_per_step: float, index: str | None) -> dict:
    """The modelled step of a run from its own counters, to set beside its measured ms/token:
    the weights and the device KV (store and index) read from HBM once a step, the host bytes a
    step moved at the large-read bandwidth for host keys (the codes dominate) and the scattered
    one otherwise, and the index's kernels (``index``: the HybridKV landmark; None: the store's)."""
    shared, member = KERNELS.get(index or "full", KERNELS["full"])
    large = index == "host-keys"
    traffic = Traffic(hbm=device_kv_bytes, link=h2d_bytes_per_step if large else 0.0,
                      scattered=0.0 if large else h2d_bytes_per_step, shared_kernels=shared, member_kernels=member)
    g = Geometry("run", layers=layers, kv_heads=1, head_dim=1, dtype_bytes=1, weight_bytes=weight_bytes)
    return {"profile": profile.name, "profile_source": profile.source,
            "ms_per_token": round(step_ms(profile, g, traffic), 4)}
