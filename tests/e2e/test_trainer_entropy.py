"""Differentiable vocab-parallel entropy (the entropy bonus): values and gradients equal torch's
entropy of the full softmax at TP=1, and TP=2 (vocab sharded over two ranks) equals TP=1."""

from __future__ import annotations

import math

import torch

from megarl.utils.dist import run_multiprocess

V = 8  # vocab of the hand-made logits; TP=2 gives each rank 4 columns

# fp32 bound: each partial sum has <= V=8 terms of size <= max|z|*e^0 ~ 10, so the sums round to
# <= 8 * 2^-24 * 10 ~ 5e-6 relative-to-one; H and dH/dz are O(1) functions of them -> atol 2e-5.
ATOL = 2e-5


def _logits() -> torch.Tensor:
    """[2, 3, V]: uniform (H = ln 8), one column +ln 7 above the rest (p = 1/2 there, 1/14 else:
    H = ln 2 / 2 + (1/2) ln 14), near one-hot (H ~ 0), and random rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, V, generator=g) * 3
    x[0, 0] = 0.0
    x[0, 1] = 0.0
    x[0, 1, 5] = math.log(7.0)
    x[0, 2] = 0.0
    x[0, 2, 2] = 30.0
    return x


def _hand_values() -> dict:
    return {(0, 0): math.log(8.0), (0, 1): 0.5 * math.log(2.0) + 0.5 * math.log(14.0), (0, 2): 0.0}


def _reference(x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's entropy of the full softmax (float64) and the gradient of sum(upstream * H)."""
    xd = x.double().requires_grad_(True)
    h = torch.distributions.Categorical(logits=xd).entropy()
    (h * upstream.double()).sum().backward()
    return h.detach(), xd.grad


def _entropy_worker(rank: int, world: int, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.trainer.logprobs import vocab_parallel_entropy
    from megarl.utils.dist import init_model_parallel

    out = {}
    for tp in (1, 2):
        init_model_parallel(tp, 1, seed=1)
        r = ps.get_tensor_model_parallel_rank()
        cols = slice(r * V // tp, (r + 1) * V // tp)
        leaf = x[..., cols].clone().requires_grad_(True)
        h = vocab_parallel_entropy(leaf * 1.0)
        (h * upstream).sum().backward()
        grads = [torch.empty_like(leaf.grad) for _ in range(tp)]
        if tp > 1:
            torch.distributed.all_gather(grads, leaf.grad.contiguous(), group=ps.get_tensor_model_parallel_group())
        else:
            grads = [leaf.grad]
        out[tp] = {"h": h.detach(), "grad": torch.cat(grads, dim=-1)}
    return out


def test_entropy_matches_torch_and_tp2_matches_tp1():
    x = _logits()
    upstream = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    want_h, want_grad = _reference(x, upstream)
    for (b, t), v in _hand_values().items():  # the reference itself is the hand value (up to the
        assert abs(float(want_h[b, t]) - v) < 1e-7, (b, t)  # fp32 rounding of ln 7 in the input, ~3e-8)
    results = run_multiprocess(_entropy_worker, 2, x, upstream, timeout_s=300)
    for rank in (0, 1):
        for tp in (1, 2):
            got = results[rank][tp]
            torch.testing.assert_close(got["h"].double(), want_h, atol=ATOL, rtol=0)
            torch.testing.assert_close(got["grad"].double(), want_grad, atol=ATOL, rtol=0)
        # the sharded computation reorders only the two partial sums: TP=2 equals TP=1 tightly
        torch.testing.assert_close(results[rank][2]["h"], results[rank][1]["h"], atol=ATOL, rtol=0)
        torch.testing.assert_close(results[rank][2]["grad"], results[rank][1]["grad"], atol=ATOL, rtol=0)


def _token_worker(rank: int, world: int, x: torch.Tensor, ids: torch.Tensor, vocab_size: int,
                  temperature: float) -> dict:
    from megarl.trainer.logprobs import token_logprobs
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(1, 1, seed=1)
    leaf = x.clone().requires_grad_(True)
    # leaf * 1.0: a non-leaf like the model's output, which the fp32 unpadded path overwrites in place
    lp, ent = token_logprobs(leaf * 1.0, ids, vocab_size, temperature, with_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "grad": leaf.grad}


def test_token_logprobs_entropy_has_the_gradient_of_the_full_softmax():
    """Through token_logprobs: the cross entropy overwrites the logits in place (fp32, no vocab
    padding), yet the entropy's gradient is intact; with padding the entropy is over the real vocab."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, V, generator=g) * 2
    ids = torch.randint(0, 6, (2, 5), generator=g)
    for vocab_size, temperature in ((V, 1.0), (6, 0.7)):
        got = run_multiprocess(_token_worker, 1, x, ids, vocab_size, temperature, timeout_s=300)[0]
        xd = x.double().requires_grad_(True)
        logp = torch.log_softmax(xd[..., :vocab_size] / temperature, -1)
        lp = torch.nn.functional.pad(logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
        ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1)[:, :-1], (1, 0))
        (lp.sum() + 0.5 * ent.sum()).backward()
        torch.testing.assert_close(got["lp"].double(), lp.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(got["ent"].double(), ent.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(got["grad"].double(), xd.grad, atol=ATOL, rtol=0)
        assert bool((got["grad"][..., vocab_size:] == 0).all())  # padding columns get no gradient
