"""Sequence packing, token-budget micro-batches and the DP token balance (``trainer.packing``,
``trainer.max_tokens_per_micro_batch``).

Packing concatenates a micro-batch's sequences without padding; the model sees the packed rows
and :meth:`PackedLayout.unpack` gathers a token-aligned ``[rows, cap]`` result (logprobs, entropy)
back to the micro-batch's right-padded ``[b, s]`` layout, so the loss code is unchanged.

Two ways to tell the model where a sequence starts:

* **CPU (megatron-core's local layer spec).** Its ``DotProductAttention.forward`` asserts
  ``packed_seq_params is None`` ("Packed sequence is not supported by DotProductAttention"), so
  packing goes through the explicit mask: first-fit-decreasing into rows of capacity = the
  micro-batch's longest sequence (not one long row: attention costs O(L^2) per row on CPU), a
  block-diagonal causal mask, position_ids restarting at 0 per sequence. megatron-core's
  ``GPTModel`` with ``position_embedding_type="rope"`` computes its rotary table for positions
  0..s-1 of the row and does not read ``position_ids`` (gpt_model.py: ``self.rotary_pos_emb(
  rotary_seq_len, ...)``); a sequence at row offset o therefore rotates q and k by angles of
  positions o..o+len-1. RoPE scores depend on the position difference only (R(i)q . R(j)k =
  q . R(j-i)k), so within a block the scores are those of positions 0..len-1 up to the fp32
  rounding of the larger angles. position_ids are still given (restarting at 0) for an absolute
  position embedding.
* **GPU (transformer-engine spec).** megatron-core's THD path: all sequences in one row, no mask,
  :func:`thd_packed_seq_params` (cu_seqlens) passed as ``packed_seq_params``; RoPE then restarts
  per sequence inside megatron (``packed_seq=True``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``sizes`` in bins of total size <= ``capacity``: longest first (ties by index),
    each into the first bin with room; an item larger than ``capacity`` gets a bin of its own.
    Deterministic (every rank computes the same bins)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, r in enumerate(room):
            if sizes[i] <= r:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


def balanced_partition(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """``sizes``' indices in ``parts`` sets of about equal total: greedy largest-first (LPT; ties by
    index) into the set with the smallest total so far (ties: the lowest set). Each set's indices in
    ascending order. Deterministic. The totals differ by at most max(sizes): the set that ends
    largest was the smallest when it took its last item."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    out: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(parts), key=lambda p: (totals[p], p))
        out[p].append(i)
        totals[p] += sizes[i]
    return [sorted(p) for p in out]


def token_budget_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices of micro-batches each holding at most ``max_tokens`` real tokens (a longer
    sequence goes alone), formed by length (first-fit decreasing); each micro-batch's rows in
    ascending order."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return [sorted(b) for b in first_fit_decreasing(list(lengths), max_tokens)]


def thd_packed_seq_params(lengths: torch.Tensor):
    """megatron-core's ``PackedSeqParams`` for sequences of ``lengths`` concatenated in one row (THD
    format, transformer-engine attention): cu_seqlens = [0, l0, l0+l1, ...] (int32) for q and kv,
    max_seqlen the longest sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    longest = int(lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


@dataclasses.dataclass
class PackedLayout:
    """A micro-batch's sequences packed into ``[rows, cap]``.

    input_ids, position_ids: [rows, cap] (positions restart at 0 per sequence; the free tail of a
        row holds token 0 at positions 0.. as a sequence of its own, whose results are dropped).
    attention_mask: [rows, 1, cap, cap] bool, True = masked: block-diagonal causal; None on the THD
        path (``packed_seq_params`` set instead).
    row, offset: [b] where sequence i of the micro-batch starts.
    lengths: [b]; width: the micro-batch's padded width s.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    row: torch.Tensor
    offset: torch.Tensor
    lengths: torch.Tensor
    width: int
    packed_seq_params: object | None = None

    def model_inputs(self) -> dict:
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids,
               "attention_mask": self.attention_mask}
        if self.packed_seq_params is not None:
            out["packed_seq_params"] = self.packed_seq_params
        return out

    def pack_like(self, per_token: torch.Tensor, fill) -> torch.Tensor:
        """A per-token ``[b, s, ...]`` tensor of the micro-batch (e.g. ``RolloutBatch.routed_experts``)
        laid out as the packed ``[rows, cap, ...]`` tokens: sequence i at ``row[i], offset[i]``; the
        free tails hold ``fill``."""
        rows = int(self.input_ids.shape[0])
        cap = int(self.input_ids.shape[1])
        out = torch.full((rows, cap, *per_token.shape[2:]), fill, dtype=per_token.dtype, device=per_token.device)
        for i, (r, o, n) in enumerate(zip(self.row.tolist(), self.offset.tolist(), self.lengths.tolist())):
            out[r, o:o + n] = per_token[i, :n]
        return out

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Token-aligned ``[rows, cap]`` -> the micro-batch's ``[b, s]`` (differentiable gather).
        Position 0 of a sequence has no logprob (its packed neighbour is the previous sequence's
        last token) and padding has none: both are 0."""
        cap = packed.shape[1]
        pos = torch.arange(self.width, device=packed.device).unsqueeze(0)
        valid = (pos >= 1) & (pos < self.lengths.unsqueeze(1))
        flat = (self.row * cap + self.offset).unsqueeze(1) + pos
        flat = torch.where(valid, flat, torch.zeros_like(flat))
        got = packed.reshape(-1).index_select(0, flat.reshape(-1)).view(flat.shape)
        return torch.where(valid, got, torch.zeros_like(got))


def pack(input_ids: torch.Tensor, lengths: torch.Tensor, *, thd: bool = False) -> PackedLayout:
    """Pack right-padded rows ``input_ids [b, s]`` of ``lengths``. ``thd=False`` (the local spec):
    first-fit decreasing into rows of capacity max(lengths) with a block-diagonal causal mask;
    ``thd=True`` (transformer-engine): one row of every sequence and its ``PackedSeqParams``."""
    b, s = input_ids.shape
    dev = input_ids.device
    lens = [int(n) for n in lengths.tolist()]
    if thd:
        bins, cap = [list(range(b))], sum(lens)
    else:
        cap = max(lens)
        bins = first_fit_decreasing(lens, cap)
    ids = torch.zeros(len(bins), cap, dtype=torch.long, device=dev)
    positions = torch.zeros(len(bins), cap, dtype=torch.long, device=dev)
    segment = torch.zeros(len(bins), cap, dtype=torch.long, device=dev)
    row = torch.zeros(b, dtype=torch.long)
    offset = torch.zeros(b, dtype=torch.long)
    for r, members in enumerate(bins):
        at = 0
        for k, i in enumerate(members):
            n = lens[i]
            ids[r, at:at + n] = input_ids[i, :n]
            positions[r, at:at + n] = torch.arange(n, device=dev)
            segment[r, at:at + n] = k
            row[i], offset[i] = r, at
            at += n
        positions[r, at:] = torch.arange(cap - at, device=dev)  # the free tail: a sequence of its own
        segment[r, at:] = len(members)
    mask, params = None, None
    if thd:
        params = thd_packed_seq_params(lengths.to(dev))
    else:
        same = segment.unsqueeze(2) == segment.unsqueeze(1)  # [rows, q, k]
        causal = torch.ones(cap, cap, dtype=torch.bool, device=dev).tril()
        mask = (~(same & causal)).unsqueeze(1)
    return PackedLayout(ids, positions, mask, row.to(dev), offset.to(dev), lengths.to(dev), s, params)
