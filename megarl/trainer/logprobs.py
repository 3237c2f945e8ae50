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


def aligned_logprobs(logits: torch.Tensor, mb: RolloutBatch, layout, vocab_size: int, temperature: float = 1.0,
                     with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` of a micro-batch in its padded ``[b, s]`` layout, whether the model saw
    it padded (``layout`` None) or packed (a :class:`~megarl.trainer.packing.PackedLayout`, whose
    result is gathered back; 0 at position 0 and on padding)."""
    if layout is None:
        return token_logprobs(logits, mb.input_ids, vocab_size, temperature, with_entropy)
    lp, ent = token_logprobs(logits, layout.input_ids, vocab_size, temperature, with_entropy)
    return layout.unpack(lp), (None if ent is None else layout.unpack(ent))


def uses_thd(model) -> bool:
    """Whether packed sequences go through megatron-core's THD path (transformer-engine layer spec)
    rather than the explicit block-diagonal mask (the local spec, CPU)."""
    from megarl.trainer.model import unwrap

    return getattr(unwrap(model), "megarl_norm_style", "local") == "te"


def run_pipeline(model, micro_batches: list[RolloutBatch], on_logits: Callable[..., tuple], forward_only: bool,
                 packing: bool = False) -> list:
    """Run megatron's forward(-backward) schedule over the micro-batches. ``on_logits(mb, logits,
    layout)`` runs on the last PP stage and returns megatron's loss-func tuple (``layout``: None, or
    the micro-batch's packing when ``packing``; :func:`aligned_logprobs` takes both); returns the
    schedule's per-micro-batch outputs (non-empty on the last stage only). Every PP stage packs the
    same rows the same way (deterministic), so the stages agree on the shapes.

    An MoE model with a router replayer (``megarl_router_replayer``, megarl/trainer/router_stats.py)
    gets each micro-batch's ``routed_experts`` in the forward's token layout (packed like its tokens)
    before its forward: replayed with trainer.router_replay, counted for moe/routing_mismatch either
    way; a micro-batch without them routes on its own."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.trainer.model import unwrap
    from megarl.trainer.packing import pack
    from megarl.trainer.router_replay import UNKNOWN, model_order

    device = next(model.parameters()).device
    micro_batches = [mb.to(device) for mb in micro_batches]
    thd = packing and uses_thd(model)
    layouts = [pack(mb.input_ids, mb.lengths, thd=thd) if packing else None for mb in micro_batches]
    shapes = [tuple(lay.input_ids.shape) if lay is not None else tuple(mb.input_ids.shape)
              for mb, lay in zip(micro_batches, layouts)]

    replayer = getattr(unwrap(model), "megarl_router_replayer", None)

    def forward_step(data_iterator, model_chunk):
        mb, layout = next(data_iterator)
        inputs = mb.model_inputs() if layout is None else layout.model_inputs()
        if replayer is not None:
            ids = mb.routed_experts
            if ids is not None and layout is not None:
                ids = layout.pack_like(ids, UNKNOWN)
            replayer.set_targets(None if ids is None else model_order(ids))
        return model_chunk(**inputs), functools.partial(on_logits, mb, layout=layout)

    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(list(zip(micro_batches, layouts))),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=max(s for _, s in shapes),
            micro_batch_size=max(b for b, _ in shapes),
            forward_only=forward_only,
        )
    finally:
        if replayer is not None:
            replayer.clear()


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


def dp_rows(batch: RolloutBatch, balance_tokens: bool) -> list[torch.Tensor]:
    """Every DP rank's rows of the global batch (ascending indices), the same list on every rank:
    contiguous equal slices (rows must divide by dp), or with ``balance_tokens`` a balanced
    partition of the sequence lengths (token counts within the longest sequence of each other; row
    counts may differ; needs rows >= dp)."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.packing import balanced_partition

    dp = ps.get_data_parallel_world_size()
    if not balance_tokens:
        if batch.batch_size % dp:
            raise ValueError(f"batch of {batch.batch_size} sequences does not split over data parallel size "
                             f"dp={dp}: make the global batch a multiple of dp")
        per = batch.batch_size // dp
        return [torch.arange(r * per, (r + 1) * per) for r in range(dp)]
    if batch.batch_size < dp:
        raise ValueError(f"batch of {batch.batch_size} sequences is smaller than the data parallel size dp={dp}")
    return [torch.tensor(p, dtype=torch.long) for p in balanced_partition(batch.lengths.tolist(), dp)]


def micro_batch_rows(batch: RolloutBatch, micro_batch_size: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Row indices of ``batch``'s micro-batches: ``micro_batch_size`` consecutive rows each, or with
    ``max_tokens`` > 0 formed by length, each at most ``max_tokens`` real tokens (a longer sequence
    alone). Deterministic, so the PP stages of a pipeline (which see the same rows) agree on the count."""
    from megarl.trainer.packing import token_budget_groups

    if max_tokens <= 0:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [torch.arange(i, min(i + micro_batch_size, batch.batch_size))
                for i in range(0, batch.batch_size, micro_batch_size)]
    return [torch.tensor(g, dtype=torch.long) for g in token_budget_groups(batch.lengths.tolist(), max_tokens)]


@dataclasses.dataclass
class LogprobOutput:
    """Token-aligned [B, S] tensors (zero where there is no logprob: position 0 and padding)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


@torch.no_grad()
def compute_logprobs(model, batch: RolloutBatch, *, micro_batch_size: int = 8, temperature: float = 1.0,
                     with_entropy: bool = False, packing: bool = False,
                     max_tokens_per_micro_batch: int = 0) -> LogprobOutput:
    """Logprobs of ``batch.input_ids`` under ``model``. Every trainer rank calls this with the same
    batch and gets the whole result; DP replicas each compute their share of the rows (contiguous
    when the rows divide by dp; token-balanced with a token budget, when rows >= dp) and exchange
    results. ``packing`` and ``max_tokens_per_micro_batch``: ``trainer.packing`` and
    ``trainer.max_tokens_per_micro_batch``."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.model import unwrap

    dp = ps.get_data_parallel_world_size()
    balance = max_tokens_per_micro_batch > 0
    split = dp > 1 and (batch.batch_size >= dp if balance else batch.batch_size % dp == 0)
    shares = dp_rows(batch, balance) if split else [torch.arange(batch.batch_size)]
    mine = shares[ps.get_data_parallel_rank()] if split else shares[0]
    local = batch.select(mine)

    vocab = unwrap(model).megarl_dims.vocab_size
    was_training = model.training
    model.eval()

    def on_logits(mb: RolloutBatch, logits: torch.Tensor, layout=None):
        lp, ent = aligned_logprobs(logits, mb, layout, vocab, temperature, with_entropy)
        out = {"logprobs": lp}
        if ent is not None:
            out["entropy"] = ent
        return torch.zeros(()), out

    micro_rows = micro_batch_rows(local, micro_batch_size, max_tokens_per_micro_batch)
    micro = [local.select(rows) for rows in micro_rows]
    try:
        results = run_pipeline(model, micro, on_logits, forward_only=True, packing=packing)
    finally:
        model.train(was_training)
    width = max(len(r) for r in shares)  # all-gather needs one shape: pad to the largest share
    s = batch.input_ids.shape[1]
    names = ["logprobs"] + (["entropy"] if with_entropy else [])
    full = {n: torch.zeros(width, s) for n in names}
    for res, rows in zip(results, micro_rows):  # last stage only
        for n in names:
            t = res[n].cpu()
            full[n][rows, :t.shape[1]] = t
    valid = valid_token_mask(batch)
    for n in names:
        t = broadcast_from_last_stage(full[n])
        if split:
            parts = [torch.empty_like(t) for _ in range(dp)]
            torch.distributed.all_gather(parts, t, group=ps.get_data_parallel_group())
            t = torch.zeros(batch.batch_size, s)
            for rows, part in zip(shares, parts):
                t[rows] = part[:len(rows)]
        full[n] = t * valid
    return LogprobOutput(full["logprobs"], full.get("entropy"))
