"""Pinned host memory of exactly its bytes (``compression/host_memory.py``), with CUDA's runtime
stood in for: what is registered, for how long, and what happens when CUDA refuses."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from hybridkv_cli.compression import host_memory


class FakeRuntime:
    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return 1 if self.refuse else 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def runtime(monkeypatch):
    fake = FakeRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_a_large_block_is_exactly_its_pages_registered_until_its_last_view_dies(runtime):
    shape = (3, 1000, 256)  # 1.5 MB of bf16: torch's allocator would pin 2 MiB
    tensor = host_memory.host_empty(shape, torch.bfloat16)
    assert tensor.shape == shape and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    nbytes = 3 * 1000 * 256 * 2
    assert tensor.untyped_storage().nbytes() == nbytes
    (ptr, size, flags), = runtime.registered
    assert (ptr, size, flags) == (tensor.data_ptr(), nbytes, host_memory.REGISTER_FLAGS)
    assert ptr % mmap.PAGESIZE == 0
    tensor.copy_(torch.arange(tensor.numel()).view(shape) % 7)
    view = tensor[1:, 5]  # a view keeps the pages (and their registration) alive
    del tensor
    gc.collect()
    assert runtime.unregistered == []
    assert torch.equal(view[0], (torch.arange(256) + 1000 * 256 + 5 * 256) % 7 * torch.ones(1, dtype=torch.bfloat16))
    del view
    gc.collect()
    assert runtime.unregistered == [ptr]


def test_a_refused_registration_clears_the_error_and_takes_the_allocator(runtime, monkeypatch):
    runtime.refuse = True
    cleared = []
    monkeypatch.setattr(host_memory, "_clear_cuda_error", lambda: cleared.append(True))
    assert host_memory._registered(1 << 21) is None
    assert cleared == [True] and runtime.unregistered == []


def test_unpinned_memory_is_plain(runtime):
    tensor = host_memory.host_empty((2, 3), torch.float32, pinned=False)
    assert tensor.shape == (2, 3) and not runtime.registered


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_registered_codes_are_read_in_place_by_the_kernel():
    """On a GPU: the block is pinned memory to torch, and the 2-bit key kernel reads codes held
    there as it reads the allocator's (the offloaded host keys of ``--landmark host-keys``)."""
    import hybridkv_kernels as hk

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(4, 40000, 128, generator=g)
    codes, bounds = hk.pack_keys(keys)  # [4, 32, 40000]: 5.1 MB
    host = host_memory.host_empty(codes.shape, codes.dtype).copy_(codes)
    assert host.is_pinned() and host.untyped_storage().nbytes() == codes.numel()
    q = torch.randn(4, 7, 128, generator=g).cuda()
    got = hk.quant_key_topk(q, host, bounds.cuda(), 1, 64, "triton")
    assert torch.equal(got, hk.quant_key_topk(q, codes.cuda(), bounds.cuda(), 1, 64, "triton"))
    assert torch.equal(host.cuda(non_blocking=True).cpu(), codes)
