"""GPU check: the nccl transport's call pattern on a real ProcessGroupNCCL (one rank, one GPU).

NCCL needs one GPU per rank, so two ranks cannot run on the lent machine; one rank can still take the
exact calls ``megarl/ddma/transport/nccl.py`` makes: ``ProcessGroupNCCL(PrefixStore, rank, size,
Options)`` under a per-group prefix, ``eager_connect_single_device``, then ``NcclTransport._round``
(``supports_coalescing``, ``_start_coalescing()``, a self send and recv that return no Work, the batch's
Work from ``_end_coalescing()``, ``wait()``) and ``NcclTransport._complete`` (the stream synchronized).
The received bytes must equal the sent ones. A second group on the same store must build too (its own
prefix). Prints one JSON line; exit 1 on failure. ``MEGARL_GPU_CHECK_PLANT=nccl`` corrupts the
received bytes (the check must fail). ``--cpu-dry``: no NCCL on CPU; checks only that the calls exist.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> int:
    dry = "--cpu-dry" in sys.argv
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT") == "nccl"
    from megarl.ddma.transport.base import group_prefix
    from megarl.ddma.transport.nccl import NcclTransport

    if dry:
        import torch._C._distributed_c10d as c10d

        ok = all(hasattr(c10d.Backend, n) for n in ("_start_coalescing", "_end_coalescing",
                                                    "eager_connect_single_device", "supports_coalescing"))
        print(json.dumps({"nccl_pattern": {"ok": ok, "dry": "no NCCL on CPU: the Backend calls exist"}}))
        return 0 if ok else 1
    out: dict = {}
    try:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        groups = []
        for _ in range(2):  # a second group on the same store: its own prefix, a fresh NCCL id
            opts = ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=60)
            prefix = group_prefix(store, "ddma/nccl", 0)
            pg = ProcessGroupNCCL(torch.distributed.PrefixStore(prefix, store), 0, 1, opts)
            pg.eager_connect_single_device(device)
            groups.append((prefix, pg))
        out["prefixes"] = [p for p, _ in groups]
        out["supports_coalescing"] = bool(groups[0][1].supports_coalescing)
        for i, (_, pg) in enumerate(groups):
            src = torch.arange(1 << 20, dtype=torch.int32, device=device) * (i + 3)
            dst = torch.zeros_like(src)
            NcclTransport._round(pg, [("send", src, 0), ("recv", dst, 0)])
            NcclTransport._complete(device)
            if plant and i == 0:
                dst[0] += 1
            out[f"group{i}_exact"] = bool(torch.equal(src, dst))
        out["ok"] = out["supports_coalescing"] and all(out[f"group{i}_exact"] for i in range(2)) \
            and len(set(out["prefixes"])) == 2
    except Exception:  # noqa: BLE001 - reported in the JSON
        out.update(ok=False, error=traceback.format_exc()[-2000:])
    print(json.dumps({"nccl_pattern": out}))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
