"""The CUDA paths against the installed torch (the API drift test): no GPU runs here, so what the
CUDA code calls is held to torch's own bindings and sources, read on CPU.

- every ``torch.cuda.*`` / ``torch.distributed.*`` name and ``from torch... import`` in the CUDA
  transports and the device checksums exists in this torch (``ProcessGroupNCCL``, absent from CPU
  builds, is checked where torch imports it);
- the call shapes: c10d ``Backend`` coalescing takes no argument (``ProcessGroup``'s takes the device),
  ``ProcessGroupNCCL(store, rank, size, options)`` as torch's own ``new_group`` builds it,
  ``rebuild_cuda_tensor``'s argument 6 is ``storage_device`` (what ``cuda_ipc.on_device`` rewrites);
- the stand-ins have the signatures of what they stand for: ``CoalescingGlooDouble`` (tests/
  test_ddma_sync.py) those of the c10d ``Backend`` binding, ``HostIpcDouble`` and tools/gpu_ddma_ipc.py's
  ``HostIpcStandIn`` those of ``CudaIpcOps``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch._C._distributed_c10d as c10d

REPO = Path(__file__).resolve().parents[2]
CUDA_PATHS = ["megarl/ddma/transport/nccl.py", "megarl/ddma/transport/cuda_ipc.py", "megarl/ddma/verify.py",
              "megarl/ddma/sender.py", "megarl/ddma/receiver.py", "megarl/ddma/sync_spec.py", "megarl/trainer/worker.py",
              "megarl/ddma/transport/buckets.py"]  # where the NCCL rounds are coalesced (BucketedTransport._post)
NCCL_ONLY = {"ProcessGroupNCCL"}  # in torch._C._distributed_c10d only when torch was built with NCCL


def _pybind_params(fn) -> list[str]:
    """Parameter names (after self) from a pybind11 signature line ``name(self: T, a: A, b: B) -> R``."""
    line = fn.__doc__.strip().splitlines()[0]
    inner = line[line.index("(") + 1:line.rindex(") ->")]
    names = [p.split(":")[0].strip() for p in re.split(r",\s*(?![^\[]*\])", inner) if p.strip()]
    return names[1:] if names and names[0] == "self" else names


def _torch_names(path: str) -> tuple[set[str], set[tuple[str, str]]]:
    """``torch.a.b`` attribute chains and ``from torch.x import y`` pairs in one source file."""
    tree = ast.parse((REPO / path).read_text())
    chains, imports = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            imports |= {(node.module, a.name) for a in node.names}
        if isinstance(node, ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch" and parts[-1] in ("cuda", "distributed", "multiprocessing"):
                chains.add("torch." + ".".join(reversed(parts)))
    return chains, imports


@pytest.mark.parametrize("path", CUDA_PATHS)
def test_cuda_paths_names_exist_in_the_installed_torch(path):
    chains, imports = _torch_names(path)
    for chain in sorted(chains):
        obj = torch
        for part in chain.split(".")[1:]:
            assert hasattr(obj, part), f"{path}: {chain} is not in torch {torch.__version__}"
            obj = getattr(obj, part)
    for module, name in sorted(imports):
        mod = importlib.import_module(module)
        if name in NCCL_ONLY and not torch.distributed.is_nccl_available():
            # a CPU build: the name must be what torch itself imports from its C extension there
            assert f"from torch._C._distributed_c10d import {name}" in inspect.getsource(mod), (path, module, name)
            continue
        assert hasattr(mod, name), f"{path}: from {module} import {name} fails in torch {torch.__version__}"


def test_bucket_rounds_call_only_what_the_c10d_backend_binding_has():
    """buckets.py posts a round on a raw c10d Backend (NCCL's on a GPU): every ``pg.<name>`` it reads
    exists on the binding, and the ops it reaches through ``getattr(pg, op)`` ("send", "recv") take
    ``(tensors, peer, tag)`` -- the three arguments _post passes. Read from the source, so a new call
    there is checked too."""
    tree = ast.parse((REPO / "megarl/ddma/transport/buckets.py").read_text())
    post = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_post")
    attrs = {n.attr for n in ast.walk(post) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == "pg"}
    assert {"supports_coalescing", "_start_coalescing", "_end_coalescing"} <= attrs, attrs
    for name in attrs:
        assert hasattr(c10d.Backend, name), f"buckets.py: pg.{name} is not on c10d.Backend in torch {torch.__version__}"
    source = ast.get_source_segment((REPO / "megarl/ddma/transport/buckets.py").read_text(), post)
    assert "getattr(pg, op)([t], peer, 0)" in source  # the op call shape checked below
    for op in ("send", "recv"):
        assert len(_pybind_params(getattr(c10d.Backend, op))) == 3, (op, getattr(c10d.Backend, op).__doc__)


def test_backend_coalescing_takes_no_argument_and_process_group_takes_the_device():
    """nccl.py calls the Backend form (a raw ProcessGroupNCCL is a Backend); passing the device, the
    ProcessGroup form, was a TypeError at the first CUDA round."""
    assert _pybind_params(c10d.Backend._start_coalescing) == []
    assert "Work" in c10d.Backend._end_coalescing.__doc__.splitlines()[0].split("->")[1]
    assert _pybind_params(c10d.ProcessGroup._start_coalescing) == ["device_type"]
    assert isinstance(inspect.getattr_static(c10d.Backend, "supports_coalescing"), property)
    assert _pybind_params(c10d.Backend.eager_connect_single_device) == ["arg0"]
    assert _pybind_params(c10d.Backend.send) == ["tensors", "dstRank", "tag"]
    assert _pybind_params(c10d.Backend.recv) == ["tensors", "srcRank", "tag"]


def test_process_group_nccl_is_built_as_torch_builds_it():
    """``ProcessGroupNCCL(prefix_store, rank, size, options)`` with ``ProcessGroupNCCL.Options()`` and
    its ``_timeout``: the call torch's own ``_new_process_group_helper`` makes (a CPU build has no NCCL
    class to call, so its source is the reference; a CUDA build is checked on the class too)."""
    import torch.distributed.distributed_c10d as dc

    src = inspect.getsource(dc)
    calls = [" ".join(m.group(1).split()) for m in re.finditer(r"ProcessGroupNCCL\(\s*([^)]*)\)", src)]
    assert "backend_prefix_store, group_rank, group_size, backend_options" in calls, calls
    assert "ProcessGroupNCCL.Options()" in src
    assert isinstance(inspect.getattr_static(c10d.Backend.Options, "_timeout"), property)
    ours = (REPO / "megarl/ddma/transport/nccl.py").read_text()
    assert "ProcessGroupNCCL(torch.distributed.PrefixStore(prefix, side.store), rank, size, opts)" in ours
    if torch.distributed.is_nccl_available():
        assert _pybind_params(dc.ProcessGroupNCCL.__init__)[:4] == ["store", "rank", "size", "options"]


def test_coalescing_stand_in_has_the_backend_signatures():
    from tests.harness.ddma import CoalescingGlooDouble

    for name in ("_start_coalescing", "_end_coalescing", "send", "recv", "eager_connect_single_device"):
        ours = list(inspect.signature(getattr(CoalescingGlooDouble, name)).parameters)[1:]
        assert ours == _pybind_params(getattr(c10d.Backend, name)), name
    assert CoalescingGlooDouble.supports_coalescing is True


def test_rebuild_cuda_tensor_argument_six_is_the_storage_device():
    from torch.multiprocessing.reductions import StorageWeakRef, rebuild_cuda_tensor, reduce_tensor

    from megarl.ddma.transport.cuda_ipc import STORAGE_DEVICE_ARG

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(params) == 15 and params[STORAGE_DEVICE_ARG] == "storage_device"
    assert "storage._share_cuda_()" in inspect.getsource(reduce_tensor)  # the CUDA branch it takes
    for name in ("_share_cuda_", "_new_shared_cuda", "_release_ipc_counter", "_weak_ref"):
        assert hasattr(torch.UntypedStorage, name), name
    assert hasattr(StorageWeakRef, "expired")


def test_cuda_calls_take_the_arguments_we_pass():
    dev = torch.device("cuda", 1)
    inspect.signature(torch.cuda.synchronize).bind(dev)
    inspect.signature(torch.cuda.current_stream).bind(dev)
    inspect.signature(torch.cuda.set_device).bind(dev)
    inspect.signature(torch.cuda.ipc_collect).bind()
    inspect.signature(torch.cuda.current_device).bind()


def _public_methods(cls) -> dict[str, list[str]]:
    return {n: list(inspect.signature(f).parameters) for n, f in vars(cls).items()
            if callable(f) and not n.startswith("_")}


def test_ipc_stand_ins_have_the_signatures_of_cuda_ipc_ops():
    import importlib.util

    from megarl.ddma.transport.cuda_ipc import CudaIpcOps
    from tests.harness.ddma import HostIpcDouble

    spec = importlib.util.spec_from_file_location("gpu_ddma_ipc", REPO / "tools" / "gpu_ddma_ipc.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    want = _public_methods(CudaIpcOps)
    assert set(want) == {"export", "open", "synchronize", "collect"}
    for double in (HostIpcDouble, tool.HostIpcStandIn):
        assert _public_methods(double) == want, double.__name__


def test_extension_builds_with_the_cxx_standard_torch_chooses():
    """setup.py passes no -std (for g++ or nvcc): torch's BuildExtension then adds the standard it writes
    its headers for (c++20 in torch 2.13, whose headers use C++20 bit-field initializers that
    -std=c++17 took only as an extension), which is at least the minimum the headers enforce."""
    import torch.utils.cpp_extension as ce

    tree = ast.parse((REPO / "setup.py").read_text())
    flags = [elt.value for node in ast.walk(tree) if isinstance(node, ast.Dict)
             for k, v in zip(node.keys, node.values)
             if isinstance(k, ast.Constant) and k.value in ("cxx", "nvcc") and isinstance(v, ast.List)
             for elt in v.elts if isinstance(elt, ast.Constant)]
    assert "-O3" in flags and not [f for f in flags if f.startswith("-std")], flags
    chosen = re.search(r"cpp_flag_prefix \+ '(c\+\+(\d+))'", inspect.getsource(ce))
    assert chosen, "torch's BuildExtension no longer adds a default C++ standard: set one in setup.py"
    header = Path(ce.include_paths()[0]) / "torch" / "csrc" / "api" / "include" / "torch" / "all.h"
    required = [int(y) for y in re.findall(r"__cplusplus < (\d{4})\d\dL", header.read_text())]
    assert required and 2000 + int(chosen.group(2)) >= max(required), (chosen.group(1), required)
