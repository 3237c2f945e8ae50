"""Per-token log-probabilities (and entropy) of given sequences under the Megatron model.

Temperature convention: ``logprob = log_softmax(logits / temperature)``. vLLM returns the
*untempered* distribution's logprobs by default (``logprobs_mode="raw_logprobs"``) even when it
samples at T != 1, so the matching trainer setting is ``temperature=1.0`` (the default). Only when
the generator runs with ``logprobs_mode="processed_logprobs"`` should the trainer pass the sampling
temperature here.

Logits are vocab-parallel over TP (each rank holds ``padded_vocab / tp`` columns); the padding
columns (ids >= the real vocab size) are masked out so the distribution is over the real vocab
only, exactly as in HF. Forward passes run through megatron's pipeline schedule, so PP works.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from megarl.batch import RolloutBatch

_MASKED_LOGIT = -1e30  # finite, so 0 * logit stays 0 in the entropy sum


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 vocab-parallel logits with the padding columns masked. A new tensor when it must
    cast or mask; otherwise ``logits`` itself (the caller decides whether it may be modified)."""
    from megatron.core import parallel_state as ps

    v_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    out = logits.float()
    if start + v_local > vocab_size:
        pad = torch.arange(start, start + v_local, device=logits.device) >= vocab_size
        out = out.masked_fill(pad, _MASKED_LOGIT)  # a new tensor
    return out


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the TP-sharded last dim (fp32 logits, padding masked);
    differentiable.

    H = log S0 - S1 / S0 with S0 = sum_v exp(z_v), S1 = sum_v exp(z_v) z_v, z = logits - m. The
    identity holds for any m, so the max is detached (it cancels; it only keeps exp in range).
    Each rank sums its own vocab shard and the partial sums are all-reduced with megatron's
    autograd-aware reduction (all-reduce forward, identity backward): every TP rank computes the
    same downstream loss, so dL/dS is the same everywhere and its local copy is each shard's
    gradient. Backward keeps exp(z) and z ([..., v_local] each) alive until the backward pass."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = ps.get_tensor_model_parallel_group()
    m = logits.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    z = logits - m
    e = z.exp()
    sums = reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), (e * z).sum(-1)]).contiguous(), group)
    return sums[0].log() - sums[1] / sums[0]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-aligned logprobs ``out[b, t] = log p(input_ids[b, t] | < t)`` (``out[:, 0] = 0``) from
    vocab-parallel logits ``[b, s, v_local]``; differentiable. Entropy likewise aligned
    (``ent[b, t]`` is the entropy of the distribution token t was drawn from) and differentiable
    when ``logits`` require grad (the entropy bonus). May overwrite ``logits`` (fp32, unpadded
    vocab): pass the model's output and do not reuse it."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # The whole [b, s, v] tensor with next-token labels (the last column's label is a dummy and its
    # result is dropped): no strided slice, and no copy when the logits are fp32 without vocab
    # padding -- vocab_parallel_cross_entropy then works in place on the model's output, exactly as
    # megatron's own loss does (nothing else reads the logits afterwards).
    scaled = mask_padded_vocab(logits, vocab_size)
    if temperature != 1.0:
        scaled = scaled / temperature
    entropy = None
    if with_entropy:
        # Before the cross entropy overwrites ``scaled``: the entropy's graph saves exp(z) and z
        # (new tensors), never ``scaled`` itself, so the in-place overwrite cannot corrupt it.
        entropy = torch.nn.functional.pad(vocab_parallel_entropy(scaled[:, :-1]), (1, 0))
    labels = torch.roll(input_ids, -1, dims=1)
    nll = vocab_parallel_cross_entropy(scaled, labels)
    return torch.nn.functional.pad(-nll[:, :-1], (1, 0)), entropy


def valid_token_mask(batch: RolloutBatch) -> torch.Tensor:
    """[B, S] bool: positions 1..len-1 of each row (the positions that have a logprob)."""
    pos = torch.arange(batch.input_ids.shape[1]).unsqueeze(0)
    return (pos >= 1) & (pos < batch.lengths.unsqueeze(1))


def run_pipeline(model, micro_batches: list[RolloutBatch],
                 on_logits: Callable[[RolloutBatch, torch.Tensor], tuple], forward_only: bool) -> list:
    """Run megatron's forward(-backward) schedule over the micro-batches. ``on_logits(mb, logits)``
    runs on the last PP stage and returns megatron's loss-func tuple; returns the schedule's
    per-micro-batch outputs (non-empty on the last stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device
    micro_batches = [mb.to(device) for mb in micro_batches]

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        return model_chunk(**mb.model_inputs()), functools.partial(on_logits, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(mb.input_ids.shape[1] for mb in micro_batches),
        micro_batch_size=max(mb.batch_size for mb in micro_batches),
        forward_only=forward_only,
    )


def broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    """Give every PP stage the last stage's tensor (same shape/dtype already allocated)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        src = ps.get_pipeline_model_parallel_last_rank()
        torch.distributed.broadcast(tensor, src=src, group=ps.get_pipeline_model_parallel_group())
    return tensor


def dp_share(batch: RolloutBatch) -> RolloutBatch:
    """This DP rank's contiguous rows of the global batch (rows must divide by dp)."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if batch.batch_size % dp:
        raise ValueError(f"batch of {batch.batch_size} sequences does not split over data parallel size "
                         f"dp={dp}: make the global batch a multiple of dp")
    per = batch.batch_size // dp
    return batch.select(slice(rank * per, (rank + 1) * per))


@dataclasses.dataclass
class LogprobOutput:
    """Token-aligned [B, S] tensors (zero where there is no logprob: position 0 and padding)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


@torch.no_grad()
def compute_logprobs(model, batch: RolloutBatch, *, micro_batch_size: int = 8, temperature: float = 1.0,
                     with_entropy: bool = False) -> LogprobOutput:
    """Logprobs of ``batch.input_ids`` under ``model``. Every trainer rank calls this with the same
    batch and gets the whole result; DP replicas each compute their share of the rows (when the
    rows divide by dp) and exchange results."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.model import unwrap

    dp = ps.get_data_parallel_world_size()
    split = dp > 1 and batch.batch_size % dp == 0
    local = dp_share(batch) if split else batch

    vocab = unwrap(model).megarl_dims.vocab_size
    was_training = model.training
    model.eval()

    def on_logits(mb: RolloutBatch, logits: torch.Tensor):
        lp, ent = token_logprobs(logits, mb.input_ids, vocab, temperature, with_entropy)
        out = {"logprobs": lp}
        if ent is not None:
            out["entropy"] = ent
        return torch.zeros(()), out

    try:
        results = run_pipeline(model, local.micro_batches(micro_batch_size), on_logits, forward_only=True)
    finally:
        model.train(was_training)
    b, s = local.batch_size, batch.input_ids.shape[1]
    names = ["logprobs"] + (["entropy"] if with_entropy else [])
    full = {n: torch.zeros(b, s) for n in names}
    row = 0
    for res in results:  # last stage only
        for n in names:
            t = res[n]
            full[n][row:row + t.shape[0], :t.shape[1]] = t
        row += res["logprobs"].shape[0]
    valid = valid_token_mask(batch)
    for n in names:
        t = broadcast_from_last_stage(full[n])
        if split:
            parts = [torch.empty_like(t) for _ in range(dp)]
            torch.distributed.all_gather(parts, t, group=ps.get_data_parallel_group())
            t = torch.cat(parts)
        full[n] = t * valid
    return LogprobOutput(full["logprobs"], full.get("entropy"))
