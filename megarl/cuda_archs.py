"""Which GPU generations megarl's CUDA kernels (csrc/cuda/) are built for, and which GPUs can run them.

Standalone (standard library only): ``setup.py`` loads this file by path to pick nvcc's ``-gencode``
flags before megarl is installed, and ``megarl.native`` asks it whether a GPU can run the build.

A build holds SASS for each of :data:`DEFAULT_ARCHS` and PTX for the newest: SASS ``sm_XY`` runs on GPUs
of major X with minor >= Y (sm_80 on an A10's 8.6), PTX ``compute_XY`` is compiled by the driver at load
for any GPU of capability >= X.Y (a GPU newer than the build). Older GPUs run neither.
"""

from __future__ import annotations

from typing import Iterable, Sequence

# A100 (8.0; A10/A40/RTX 30 at 8.6 run it), L40S / RTX 4090 (8.9), H100 / H200 (9.0), B200 (10.0).
DEFAULT_ARCHS = ("80", "89", "90", "100")
ARCHS_ENV = "MEGARL_CUDA_ARCHS"  # e.g. "80;90" or "8.0 9.0" (TORCH_CUDA_ARCH_LIST's spellings)


def parse_archs(text: str) -> list[str]:
    """'8.0;9.0', '80 90', '8.0,9.0+PTX' -> ['80', '90'] (a '+PTX' suffix is accepted and ignored: the
    newest always gets PTX)."""
    out = []
    for item in text.replace(";", " ").replace(",", " ").split():
        item = item.upper().removesuffix("+PTX").replace(".", "").removeprefix("SM_")
        if not item.isdigit():
            raise ValueError(f"{ARCHS_ENV}={text!r}: {item!r} is not a compute capability such as 8.0 or 90")
        out.append(item)
    return out


def gencode_flags(requested: Sequence[str], nvcc_archs: Iterable[str] | None) -> tuple[list[str], list[str]]:
    """(nvcc -gencode flags, the archs dropped because this nvcc cannot build them). ``nvcc_archs``: what
    ``nvcc --list-gpu-arch`` printed ('compute_90', ...), None when it could not say (then all are kept)."""
    known = None if nvcc_archs is None else {a.removeprefix("compute_") for a in nvcc_archs}
    keep = sorted({a for a in requested if known is None or a in known}, key=int)
    dropped = sorted(set(requested) - set(keep), key=int)
    if not keep:
        raise ValueError(f"nvcc can build none of sm_{', sm_'.join(requested)}; set {ARCHS_ENV} to archs it lists "
                         f"(nvcc --list-gpu-arch)")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in keep]
    flags.append(f"-gencode=arch=compute_{keep[-1]},code=compute_{keep[-1]}")  # PTX: newer GPUs JIT it
    return flags, dropped


def built_for(flags: Sequence[str]) -> str:
    """The build's arch list as the extension reports it ('sm_80,sm_90,compute_90'), from its flags."""
    return ",".join(f.rpartition("code=")[2] for f in flags)


def runs_on(capability: tuple[int, int], archs: str) -> bool:
    """Whether a GPU of ``capability`` (major, minor) can run a build of ``archs`` (:func:`built_for`)."""
    major, minor = capability
    for arch in filter(None, archs.split(",")):
        kind, _, num = arch.partition("_")
        a_major, a_minor = divmod(int(num), 10)
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (major, minor) >= (a_major, a_minor):
            return True
    return False


__all__ = ["ARCHS_ENV", "DEFAULT_ARCHS", "built_for", "gencode_flags", "parse_archs", "runs_on"]
