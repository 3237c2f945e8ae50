"""Shared test fixtures: tiny random checkpoints, the converted SmolLM2, and GPU-test skipping."""

from __future__ import annotations

import os

# Nothing in the tests may reach a hub: set before transformers/vLLM are imported by any test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

CUDA_AVAILABLE = torch.cuda.is_available()

# For tests that are not marked `gpu` but have a CUDA-only branch.
skip_if_no_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip (with a reason) on machines without CUDA, even under `-m gpu`. Every
    test that starts a vLLM engine, Megatron (ranks or in-process) or a `megarl` command is marked
    `processes` (tests/fast_tier.py), so `tools/run_tests.sh --fast` leaves it out."""
    from tests.fast_tier import starts_processes

    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.processes)
    if CUDA_AVAILABLE:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="marked gpu: no CUDA device on this machine"))


@pytest.fixture(autouse=True)
def _fast_tier_guard(request):
    """Under `tools/run_tests.sh --fast` (MEGARL_FAST_TESTS=1) a test that starts a process after all
    fails, naming what it started: tests/fast_tier.py's STARTERS then lack its starter."""
    if os.environ.get("MEGARL_FAST_TESTS") != "1":
        yield
        return
    from tests.fast_tier import guarded

    with guarded(request.node.nodeid):
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Random 2-layer Llama (hidden 128, 4 heads / 2 KV heads, head_dim 32), untied, fp32."""
    from megarl.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory):
    """Like tiny_llama_dir but with tied input/output embeddings (as SmolLM2 has)."""
    from megarl.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("tiny_llama_tied"), "llama", tie_word_embeddings=True, seed=1
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Random 2-layer Qwen2 with non-zero q/k/v biases, untied, fp32."""
    from megarl.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF folder (bf16), converted once and cached under data_dir()."""
    from megarl.models.smollm2 import ensure_smollm2_hf

    return ensure_smollm2_hf()


@pytest.fixture(scope="session")
def tiny_llama32_dir(tmp_path_factory):
    """Random 2-layer Llama 3.2-style model: tied, ``llama3`` rope scaling (factor 32; see
    megarl.models.tiny.LLAMA32_TINY_ROPE for why original_max_position_embeddings is 64), fp32."""
    from megarl.models.tiny import LLAMA32_TINY_ROPE, make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama32"), "llama", tie_word_embeddings=True,
                                   rope_scaling=LLAMA32_TINY_ROPE, seed=3)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """Random 2-layer Qwen3: q_norm / k_norm random around 1, head_dim 64 != hidden 128 / 4 heads, untied."""
    from megarl.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", head_dim=64, seed=4)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    """Random 2-layer Mistral without a sliding window, untied, fp32."""
    from megarl.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=5)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory):
    """Random 2-layer Qwen3-MoE: layer 0 sparse (4 experts, top-2, renormalized, expert intermediate 64),
    layer 1 dense (``mlp_only_layers=[1]``, intermediate 256); head_dim 64, 4 heads / 2 KV heads, untied."""
    from megarl.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", head_dim=64, seed=6,
                                   extra_config={"mlp_only_layers": [1]})
