"""CUDA parity of every loss: same loss, gradient and metrics as on CPU (bf16 and fp32 inputs).

Marked `gpu`: skipped on machines without CUDA. It proves the losses have no CPU-only code path
(device of the helper tensors, the single-transfer metric conversion, bincount on device).
"""

import pytest
import torch

from megarl.algorithms import AlgorithmConfig, compute_advantages, loss_params, policy_loss
from megarl.algorithms.config import LOSS_NAMES


def _batch(device, dtype):
    g = torch.Generator().manual_seed(11)
    mu = torch.rand(4, 16, generator=g).clamp(min=0.02).log()
    pi = mu + 0.5 * torch.randn(4, 16, generator=g)
    mask = torch.rand(4, 16, generator=g) > 0.25
    mask[3] = False
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = compute_advantages("grpo", rewards.to(device), group_size=2)
    versions = torch.tensor([9, 8, 7, 9])
    to = dict(device=device)
    return dict(logprobs=pi.to(dtype=dtype, **to).requires_grad_(True), behav_logprobs=mu.to(**to),
                advantages=adv, mask=mask.to(**to), versions=versions.to(**to), current_version=9,
                ref_logprobs=mu.to(**to), entropy=(-pi).to(**to))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_cuda_matches_cpu(loss, dtype):
    cfg = AlgorithmConfig(loss=loss, kl_coef=0.01, entropy_coef=0.001, dual_clip_c=3.0, score_centering=True)
    results = []
    for device in ("cpu", "cuda"):
        batch = _batch(device, dtype)
        if loss == "decoupled_ppo":
            batch["prox_logprobs"] = (batch["behav_logprobs"] + batch["logprobs"].detach().float()) / 2
        value, metrics = policy_loss(cfg.loss, **batch, **loss_params(cfg))
        value.backward()
        results.append((value.detach().cpu(), batch["logprobs"].grad.float().cpu(), metrics))
    (v_cpu, g_cpu, m_cpu), (v_gpu, g_gpu, m_gpu) = results
    # fp32 math (bf16 inputs upcast): CPU vs CUDA exp/log + 64-token sums differ ~64 * 2^-24 ~ 4e-6 relative
    torch.testing.assert_close(v_gpu, v_cpu, rtol=1e-5, atol=1e-6)
    # per-token fp32 grads differ by a few ulps (~1e-7); bf16 grads pass only if no bf16 rounding (2^-8) flips
    torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-4, atol=1e-6)
    assert m_gpu.keys() == m_cpu.keys()
    for key in m_cpu:
        # float64/fp32 means over <= 64 tokens: ~4e-6 relative at worst; abs for metrics that are ~0
        assert m_gpu[key] == pytest.approx(m_cpu[key], rel=1e-4, abs=1e-6), key
