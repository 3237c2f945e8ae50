"""Which GPU generations the CUDA kernels are built for (megarl/cuda_archs.py, setup.py's -gencode flags) and
what a GPU they cannot run gets (megarl.native.cuda_kernels_for). No GPU here: the GPU's answers
(capability, name) are the one boundary faked, in the tests named ``..._faked_gpu``."""

from __future__ import annotations

import warnings

import pytest
import torch

from megarl import cuda_archs, native

BUILD = cuda_archs.built_for(cuda_archs.gencode_flags(cuda_archs.DEFAULT_ARCHS, None)[0])


def test_the_default_build_is_sass_for_four_generations_and_ptx_for_the_newest():
    flags, dropped = cuda_archs.gencode_flags(cuda_archs.DEFAULT_ARCHS, None)
    assert dropped == []
    assert BUILD == "sm_80,sm_89,sm_90,sm_100,compute_100"
    assert flags[-1] == "-gencode=arch=compute_100,code=compute_100"


def test_archs_this_nvcc_cannot_build_are_dropped_and_named():
    # CUDA 12.4's nvcc lists up to compute_90: sm_100 is dropped, PTX moves to compute_90
    listed = ["compute_50", "compute_80", "compute_86", "compute_89", "compute_90"]
    flags, dropped = cuda_archs.gencode_flags(cuda_archs.DEFAULT_ARCHS, listed)
    assert dropped == ["100"]
    assert cuda_archs.built_for(flags) == "sm_80,sm_89,sm_90,compute_90"
    with pytest.raises(ValueError, match="nvcc can build none of sm_100"):
        cuda_archs.gencode_flags(["100"], listed)


@pytest.mark.parametrize("text, want", [("8.0;9.0", ["80", "90"]), ("80 90", ["80", "90"]),
                                        ("8.6,9.0+PTX", ["86", "90"]), ("sm_89", ["89"])])
def test_arch_lists_are_read_in_torch_cuda_arch_list_spellings(text, want):
    assert cuda_archs.parse_archs(text) == want


def test_a_misspelt_arch_list_is_refused_naming_it():
    with pytest.raises(ValueError, match="MEGARL_CUDA_ARCHS='hopper'"):
        cuda_archs.parse_archs("hopper")


@pytest.mark.parametrize("gpu, capability, runs", [
    ("A100", (8, 0), True), ("A10 (sm_80 SASS, same major)", (8, 6), True), ("L40S", (8, 9), True),
    ("H100", (9, 0), True), ("B200", (10, 0), True), ("RTX 5090 (compute_100 PTX, JIT)", (12, 0), True),
    ("V100", (7, 0), False), ("T4", (7, 5), False)])
def test_which_gpus_run_the_default_build(gpu, capability, runs):
    assert cuda_archs.runs_on(capability, BUILD) is runs, gpu


def test_without_ptx_a_newer_gpu_runs_nothing():
    assert not cuda_archs.runs_on((10, 0), "sm_80,sm_90")  # SASS never crosses a major version
    assert cuda_archs.runs_on((9, 0), "sm_80,compute_80")  # PTX does, upward


@pytest.fixture
def faked_gpu(monkeypatch):
    """A GPU of a given capability behind torch.cuda, and a build of the default archs."""
    def fake(capability, name):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(native, "native_function", lambda n: (lambda: BUILD) if n == "cuda_archs" else None)
        monkeypatch.setattr(native, "_cuda_ok", {})
    return fake


def test_a_gpu_the_build_cannot_run_gets_the_torch_references_and_one_warning_faked_gpu(faked_gpu):
    faked_gpu((7, 0), "Tesla V100-SXM2-32GB")
    with pytest.warns(RuntimeWarning, match=r"GPU 3 \(Tesla V100-SXM2-32GB, sm_70\) can run none of them.*"
                                            r"MEGARL_CUDA_ARCHS=7\.0"):
        assert native.cuda_kernels_for(torch.device("cuda", 3)) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device
        assert native.cuda_kernels_for(torch.device("cuda", 3)) is False


def test_a_gpu_the_build_runs_uses_the_kernels_faked_gpu(faked_gpu):
    faked_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.cuda_kernels_for(torch.device("cuda", 0)) is True
