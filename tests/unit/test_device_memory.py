"""What leaves a device and what a device holds at once, checked on CPU.

- ``trainer/worker.py _shards`` returns host copies: its result is pickled to the controller, and a
  CUDA tensor there would start CUDA in the controller and put a model copy on its cuda:0. A tensor
  subclass stands for device memory (every op keeps it resident except an explicit move to the host).
- ``ddma/verify.checksum_segments`` on a device runs in chunks: its torch path holds ~40 bytes per
  element it checksums (index, HF index, gathered values, their int64 bits, weights, products), which for
  a 262M-element vocab shard is ~10 GB on a GPU vLLM fills to 90%. Chunked, the result is the same
  and the extra memory is bounded by the chunk (measured here by tracking every tensor the torch path
  allocates).
"""

from __future__ import annotations

import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DeviceResident(torch.Tensor):
    """Stands for a tensor in device memory: clone, detach, views and arithmetic keep it resident;
    only ``.cpu()`` / ``.to("cpu")`` give a plain host tensor."""

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(
                a == "cpu" or a == torch.device("cpu") for a in (*args[1:], kwargs.get("device"))
                if isinstance(a, (str, torch.device))))
            if isinstance(out, torch.Tensor):  # .cpu() of a host tensor returns itself: re-typed here
                out = out.as_subclass(torch.Tensor if to_host else cls)
        return out


def test_trainer_shards_come_back_as_host_copies(monkeypatch):
    from megatron.core import parallel_state as ps

    import megarl.trainer.shards as shards
    from megarl.trainer.worker import _shards

    param = torch.arange(12, dtype=torch.float32).reshape(3, 4).as_subclass(DeviceResident)
    specs = [types.SimpleNamespace(describe=lambda: {"hf_name": "w"}, local_view=param[1:], is_tied_copy=False),
             types.SimpleNamespace(describe=lambda: {"hf_name": "tied"}, local_view=param, is_tied_copy=True)]
    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda: 0)
    monkeypatch.setattr(shards, "local_shard_specs", lambda model: specs)
    out = _shards(types.SimpleNamespace(model=None))
    assert [d for d, _ in out] == [{"hf_name": "w"}]  # the tied copy is not sent
    t = out[0][1]
    assert type(t) is torch.Tensor and t.device.type == "cpu"  # not a device tensor
    assert torch.equal(t, torch.arange(4, 12, dtype=torch.float32).reshape(2, 4))
    assert t.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()  # a copy, not a view


class _PeakTensorBytes(TorchDispatchMode):
    """Live bytes of the tensors allocated under this mode (each op's new outputs), and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s.data_ptr()
                if key in inputs or key in self._seen or s.nbytes() == 0:
                    continue  # a view or an in-place result: nothing new
                self._seen.add(key)
                self.live += s.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key, s.nbytes())
        return out

    def _free(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_checksum_in_chunks_equals_the_whole_and_bounds_memory(dtype):
    from megarl.ddma.verify import checksum_segments, checksum_segments_torch

    n = 3_000_003  # elements; runs of odd lengths so chunk edges fall inside segments
    flat = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
    offs = torch.tensor([0, 1_000_000, 2_500_000], dtype=torch.int64)
    lens = torch.tensor([999_999, 1_500_000, 500_003], dtype=torch.int64)
    hfs = torch.tensor([7, 5_000_000, 123], dtype=torch.int64)
    segments = (offs, lens, hfs)
    whole = checksum_segments_torch(flat, segments, chunk=n)  # one chunk: the unchunked computation
    chunk = 1 << 18  # 12 chunks over the 3M elements
    with _PeakTensorBytes() as mem:
        chunked = checksum_segments_torch(flat, segments, chunk=chunk)
    assert chunked == whole
    assert checksum_segments(flat, segments) == whole  # the C++ kernel (or the default path) agrees
    # per chunk element at most six int64 tensors live at once (index, HF index, bits, weights, product,
    # one temporary; the gathered values' own dtype is smaller): 48 bytes (40 measured), plus the small
    # per-segment tensors (64 KiB is ample for 3 segments)
    assert mem.peak <= 48 * chunk + 64 * 1024, mem.peak
    with _PeakTensorBytes() as mem_whole:
        checksum_segments_torch(flat, segments, chunk=n)
    assert mem_whole.peak >= 30 * int(lens.sum())  # the tracker sees the unchunked cost (~40 B/element)
