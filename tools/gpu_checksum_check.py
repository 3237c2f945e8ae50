"""GPU check: the DDMA digest kernel (megarl._C.weighted_checksum_segments_cuda, csrc/cuda/checksum.cu)
against the CPU kernel (weighted_checksum_segments) and the torch reference (megarl/ddma/verify.py's
checksum_segments_torch on CPU), equal to the bit: 1-, 2- and 4-byte dtypes; one segment of millions
of elements, thousands of short rows, empty segments, odd offsets, HF starts past 2**32 (the weight
keeps only its low 32 bits); a flipped bit, a swapped chunk and a zeroed chunk must each change it.
The batched form a sync uses (``weighted_checksum_segments_cuda_add`` through verify.py's DigestBatch:
device tables, digests added on the device, one readback) gives the same sums, and its time for 146
digests of 4 MiB each (the count on one side of the 1B bench's sync) is reported beside 146 unbatched calls.
Then its speed alone over 1 GiB of bf16 beside a device-to-device copy of the same bytes (reported, not
enforced: the sync's own figure is the bench step's). Prints one JSON line; exit 1 on any difference.
``MEGARL_GPU_CHECK_PLANT=checksum`` adds 1 to one digest (the check must fail). ``--cpu-dry``: the torch
reference against the CPU kernel on CPU (control flow only)."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megarl import native  # noqa: E402
from megarl.ddma import verify  # noqa: E402
from megarl.ddma.verify import DigestBatch, checksum_segments_torch  # noqa: E402

MASK64 = (1 << 64) - 1


def _segments(numel: int, kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if kind == "one":  # the whole tensor, HF-affine
        offs, lens, hfs = [0], [numel], [12345]
    elif kind == "rows":  # short rows with gaps, odd offsets and lengths
        offs, lens, hfs, pos = [], [], [], 1
        while pos < numel - 80:
            n = int(torch.randint(0, 70, (1,), generator=g))  # 0: empty segments too
            offs.append(pos)
            lens.append(n)
            hfs.append(int(torch.randint(0, 1 << 40, (1,), generator=g)))  # past 2**32
            pos += n + int(torch.randint(0, 9, (1,), generator=g))
    else:  # a few long unordered runs crossing the kernel's 4096-element blocks
        offs, lens, hfs = [numel // 2 + 3, 7, numel // 3], [numel // 5, 4097, 9000], [3, 1 << 33, 99]
    as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return as_t(offs), as_t(lens), as_t(hfs)


def main() -> int:
    dry = "--cpu-dry" in sys.argv
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT") == "checksum"
    cpu_fn = native.native_function("weighted_checksum_segments")
    gpu_fn = native.native_function("weighted_checksum_segments_cuda")
    if dry:
        gpu_fn = lambda flat, o, n, h: checksum_segments_torch(flat, (o, n, h))  # noqa: E731
    if gpu_fn is None or cpu_fn is None:
        print(json.dumps({"checksum_kernel": {"ok": False, "error": "megarl._C lacks weighted_checksum_segments"
                                                                     "_cuda or its CPU twin (not built with CUDA)"}}))
        return 1
    dev = "cpu" if dry else "cuda"
    g = torch.Generator().manual_seed(0)
    bad, cases = [], 0
    batch, batch_want = DigestBatch(deferred=True), {}  # every case again, batched: one key per dtype
    for dtype in (torch.uint8, torch.bfloat16, torch.float32):
        for numel in (3 * 1024 * 1024 + 5, 100_003):
            raw = torch.randint(0, 256, (numel * torch.tensor([], dtype=dtype).element_size(),), generator=g,
                                dtype=torch.uint8)
            host = raw.view(dtype)
            flat = host.to(dev)
            for kind in ("one", "rows", "runs"):
                o, n, h = _segments(numel, kind, g)
                want = int(cpu_fn(host, o, n, h, True)) & MASK64
                ref = checksum_segments_torch(host, (o, n, h))
                got = int(gpu_fn(flat, o, n, h)) & MASK64
                if plant and cases == 0:
                    got = (got + 1) & MASK64
                if not (got == want == ref):
                    bad.append(f"{dtype} {numel} {kind}: kernel {got:#x} cpu {want:#x} torch {ref:#x}")
                batch.add(str(dtype), flat, (o, n, h), table_key=cases)
                batch_want[str(dtype)] = (batch_want.get(str(dtype), 0) + want) & MASK64
                cases += 1
    if not dry and verify._cuda_add_kernel(flat) is None:
        bad.append("megarl._C lacks weighted_checksum_segments_cuda_add (the batched digest): built from old csrc?")
    batched = batch.values()
    if plant:
        batched = {k: (v + 1) & MASK64 for k, v in batched.items()}
    if batched != batch_want or batch.readbacks != 1:
        bad.append(f"batched digests {batched} != {batch_want} (readbacks {batch.readbacks})")
    # planted corruptions, on the device: each must change the digest
    x = torch.randn(1 << 20, generator=g).to(torch.bfloat16).to(dev)
    segs = (torch.tensor([0]), torch.tensor([x.numel()]), torch.tensor([0]))
    base = int(gpu_fn(x, *segs))
    flipped = x.clone()
    flipped.view(torch.int16)[777] ^= 1 << 3
    swapped = x.clone()
    swapped[:4096], swapped[4096:8192] = x[4096:8192], x[:4096]
    zeroed = x.clone()
    zeroed[10_000:12_000] = 0
    caught = {name: int(gpu_fn(t, *segs)) != base for name, t in
              (("flipped bit", flipped), ("swapped chunk", swapped), ("zeroed chunk", zeroed))}
    bad += [f"{name} not caught" for name, ok in caught.items() if not ok]
    speed = {}
    if not dry:
        big = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)  # 1 GiB
        big.view(torch.int16).random_()
        segs = (torch.tensor([0]), torch.tensor([big.numel()]), torch.tensor([0]))
        other = torch.empty_like(big)
        for _ in range(2):
            gpu_fn(big, *segs)
            other.copy_(big)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            gpu_fn(big, *segs)  # syncs on its 8-byte result
        t_sum = (time.perf_counter() - t) / 5
        t = time.perf_counter()
        for _ in range(5):
            other.copy_(big)
        torch.cuda.synchronize()
        t_copy = (time.perf_counter() - t) / 5
        nbytes = big.numel() * 2
        # one side of a sync: 146 digests of 4 MiB each (the 1B bench's count), unbatched vs batched
        parts = big[:146 * (1 << 21)].view(146, -1)
        one = (torch.tensor([0]), torch.tensor([1 << 21]), torch.tensor([0]))
        times = {}
        for how in ("single", "batched", "single", "batched"):  # the second round is the one kept (warm)
            torch.cuda.synchronize()
            t = time.perf_counter()
            if how == "single":
                for i in range(146):
                    gpu_fn(parts[i], *one)
            else:
                b = DigestBatch()
                for i in range(146):
                    b.add(i % 8, parts[i], one, table_key=0)
                b.values()
            times[how] = time.perf_counter() - t
        speed = {"digests_146x4MiB_single_ms": times["single"] * 1e3,
                 "digests_146x4MiB_batched_ms": times["batched"] * 1e3, "bytes": nbytes,
                 "checksum_GBps": nbytes / t_sum / 1e9, "d2d_copy_GBps": nbytes / t_copy / 1e9,
                 "checksum_vs_copy": t_copy / t_sum}
    print(json.dumps({"checksum_kernel": {"ok": not bad, "cases": cases, "problems": bad[:10],
                                          "corruptions_caught": caught, **speed}}))
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
