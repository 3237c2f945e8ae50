"""On-policy distillation: the teacher's per-token reverse KL as a term of the advantage.

With ``algorithm.teacher`` (an HF folder) and ``algorithm.distill_coef`` > 0 the teacher's logprobs
of the tokens the student sampled, ``log q(y_t)``, come with the batch (``teacher_logprobs``, from a
forward-only teacher executor). The per-token reverse KL on the student's own samples is estimated
by ``k_t = log pi(y_t) - log q(y_t)``; its mean over reply tokens is ``distill/reverse_kl``.

Where it goes: the advantage, not the loss. Differentiating ``k_t`` directly gives
``grad log pi(y_t)``, whose expectation under pi is zero: it carries no signal. The reverse KL's
gradient is the REINFORCE one, ``E[k_t grad log pi(y_t)]``, so ``k_t`` enters as a reward:
``A_t <- A_t - distill_coef * sg(k_t)`` (per token, detached), inside ``policy_loss`` before the
loss is called. It then composes with every loss of the registry (its ratios, clips and TIS act on
the distillation term too) and with per-token advantages.

``log pi`` is the trainer's own logprob of the token (the training forward's, detached), not the
sampler's: the teacher runs the same Megatron logprob code, so a teacher identical to the student
gives the bit-identical logprob at fp32 and ``k_t = 0`` exactly (the sampler's vLLM logprob would
differ in the last bits).
"""

from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor


def reverse_kl_tokens(logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token sampled reverse-KL estimate ``log pi - log q`` (detached; 0 off ``mask``)."""
    if teacher_logprobs.shape != logprobs.shape:
        raise ValueError(f"teacher_logprobs must be [batch, seq] = {tuple(logprobs.shape)} like logprobs, got "
                         f"{tuple(teacher_logprobs.shape)}")
    m = mask.bool()
    diff = logprobs.detach() - teacher_logprobs.to(logprobs.dtype)
    return torch.where(m, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def distill_advantages(advantages: Tensor, logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor,
                       distill_coef: float) -> Tuple[Tensor, Tensor]:
    """``(A - distill_coef * sg(log pi - log q), reverse_kl)``: the advantages with the teacher's term,
    per token ``[batch, seq]``, and the masked mean of ``log pi - log q`` over ``mask`` (0-d, nats;
    0 without a reply token)."""
    if not float(distill_coef) >= 0:
        raise ValueError(f"distill_coef must be >= 0, got {distill_coef!r}")
    k = reverse_kl_tokens(logprobs, teacher_logprobs, mask)
    m = mask.bool()
    reverse_kl = k.sum() / m.sum().clamp(min=1).to(k.dtype)
    return advantages - float(distill_coef) * k, reverse_kl
