"""The rollout batch the trainer consumes, built by the controller from generated samples.

Sequences are right-padded to a rectangle ``[batch, seq]``. Every per-token tensor is aligned to
token positions: ``x[b, t]`` is about token ``input_ids[b, t]`` (e.g. ``behav_logprobs[b, t]`` is
the generator's log-probability of token t given tokens ``< t``); position 0 of a sequence has
no logprob and must be outside ``loss_mask``. This padded layout is what the loss code reads; the
trainer packs each micro-batch for the model itself (``trainer.packing``, megarl/trainer/packing.py)
and gathers the results back into it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


_PER_ROW = ("input_ids", "lengths", "group_ids")  # fields not shaped [B, S] (input_ids is the reference)


@dataclasses.dataclass
class RolloutBatch:
    """A right-padded batch of rollouts.

    input_ids:      [B, S] long, prompt + response tokens, padded with ``pad_id``.
    lengths:        [B] long, number of real tokens per row.
    loss_mask:      [B, S] float, 1 on tokens that are trained on (response tokens), else 0.
    behav_logprobs: [B, S] float, behaviour-policy (generator) logprob of each token; 0 off-mask.
    advantages:     [B, S] float, per-token advantage (a sequence advantage broadcast over tokens).
    versions:       [B, S] long, policy version that generated each token (-1 for prompt/pad).
    prox_logprobs:  optional [B, S] float, proximal-policy logprobs (decoupled PPO and friends).
    ref_logprobs:   optional [B, S] float, reference-policy logprobs (the KL penalty).
    group_ids:      optional [B] long, the prompt group of each row (its samples share an advantage
                    baseline); None = every row its own group. :meth:`minibatches` never splits a group.
    teacher_logprobs: optional [B, S] float, the distillation teacher's logprobs (algorithm.teacher).
    routed_experts: optional [B, S, moe_layers, topk] long, the engine's expert ids of each token per MoE
                    layer (``Sample.routed_experts``); -1 = not reported (padding included). The trainer
                    replays them (trainer.router_replay) and counts moe/routing_mismatch against them.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor
    behav_logprobs: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    prox_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, s = self.input_ids.shape
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is None or f.name in _PER_ROW:
                continue
            if tuple(t.shape[:2] if f.name == "routed_experts" else t.shape) != (b, s):
                raise ValueError(f"RolloutBatch.{f.name} has shape {tuple(t.shape)}, expected {(b, s)} "
                                 f"like input_ids")
        for name in ("lengths", "group_ids"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (b,):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(t.shape)}, expected ({b},)")
        if b and int(self.lengths.max()) > s:
            raise ValueError("RolloutBatch.lengths exceeds the padded sequence length")
        if s and bool((self.loss_mask[:, 0] != 0).any()):
            raise ValueError("RolloutBatch.loss_mask is set on position 0, which has no logprob")

    @classmethod
    def from_sequences(cls, tokens: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[float]],
                       behav_logprobs: Sequence[Sequence[float]] | None = None,
                       advantages: Sequence[float] | Sequence[Sequence[float]] | None = None,
                       versions: Sequence[Sequence[int]] | None = None, pad_id: int = 0,
                       pad_to_multiple_of: int = 1) -> "RolloutBatch":
        """Right-pad variable-length sequences. ``advantages`` may be one scalar per sequence
        (broadcast over its tokens) or per-token lists; missing fields default to zeros (-1 for
        versions)."""
        n = len(tokens)
        lengths = [len(t) for t in tokens]
        s = max(lengths, default=0)
        s = -(-s // pad_to_multiple_of) * pad_to_multiple_of

        def pad(rows, fill, dtype, name):
            out = torch.full((n, s), fill, dtype=dtype)
            if rows is None:
                return out
            if len(rows) != n:
                raise ValueError(f"{name}: {len(rows)} rows for {n} sequences")
            for i, row in enumerate(rows):
                if isinstance(row, (int, float)):
                    out[i, :lengths[i]] = row
                    continue
                if len(row) != lengths[i]:
                    raise ValueError(f"{name}[{i}] has {len(row)} entries for a {lengths[i]}-token sequence")
                out[i, :lengths[i]] = torch.as_tensor(row, dtype=dtype)
            return out

        return cls(
            input_ids=pad(tokens, pad_id, torch.long, "tokens"),
            lengths=torch.tensor(lengths, dtype=torch.long),
            loss_mask=pad(loss_masks, 0.0, torch.float32, "loss_masks"),
            behav_logprobs=pad(behav_logprobs, 0.0, torch.float32, "behav_logprobs"),
            advantages=pad(advantages, 0.0, torch.float32, "advantages"),
            versions=pad(versions, -1, torch.long, "versions"),
        )

    @classmethod
    def from_samples(cls, samples: Sequence, advantages: Sequence[float] | None = None,
                     pad_id: int = 0) -> "RolloutBatch":
        """Rows of prompt + completion from generator ``megarl.rollout.Sample``s; the loss covers
        the completion tokens the policy sampled (``Sample.loss_mask``: a multi-turn rollout's
        observation tokens are not trained on), which carry their behaviour logprobs and versions."""
        tokens, masks, behav, versions, groups = [], [], [], [], []
        for s in samples:
            p = len(s.prompt_ids)
            tokens.append(s.token_ids)
            own = [1.0] * len(s.completion_ids) if s.loss_mask is None else [float(m) for m in s.loss_mask]
            masks.append([0.0] * p + own)
            behav.append([0.0] * p + list(s.behav_logprobs))
            versions.append([-1] * p + list(s.versions))
            groups.append(s.group_id)
        batch = cls.from_sequences(tokens, masks, behav, advantages, versions, pad_id=pad_id)
        batch.group_ids = torch.tensor(groups, dtype=torch.long)
        batch.routed_experts = routed_experts_tensor(samples, batch.input_ids.shape[1])
        return batch

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def select(self, rows: slice | torch.Tensor) -> "RolloutBatch":
        """Rows of the batch, trimmed to their longest sequence."""
        lengths = self.lengths[rows]
        s = int(lengths.max()) if lengths.numel() else 0
        kw = {f.name: (None if getattr(self, f.name) is None else
                       getattr(self, f.name)[rows] if f.name in _PER_ROW[1:] else getattr(self, f.name)[rows, :s])
              for f in dataclasses.fields(self)}
        return RolloutBatch(**kw)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The batch with every tensor on ``device`` (the model's device on GPU machines)."""
        return RolloutBatch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                               for f in dataclasses.fields(self)})

    def minibatches(self, n: int) -> list["RolloutBatch"]:
        """The batch split along prompt groups (``group_ids``; a group is never split) into ``n``
        minibatches of consecutive groups, in order of first appearance, with group counts as equal
        as they go (the first ``groups % n`` get one more). ``n = 1``: the batch itself."""
        if n < 1:
            raise ValueError(f"minibatches must be >= 1, got {n}")
        if n == 1:
            return [self]
        ids = self.group_ids if self.group_ids is not None else torch.arange(self.batch_size)
        order: dict[int, list[int]] = {}
        for row, g in enumerate(ids.tolist()):
            order.setdefault(g, []).append(row)
        groups = list(order.values())
        if len(groups) < n:
            raise ValueError(f"a batch of {len(groups)} prompt group(s) cannot make {n} minibatches (a group is "
                             f"never split): lower trainer.minibatches or raise controller.prompts_per_step")
        per, extra = divmod(len(groups), n)
        out, start = [], 0
        for i in range(n):
            take = groups[start:start + per + (i < extra)]
            start += len(take)
            out.append(self.select(torch.tensor([r for g in take for r in g], dtype=torch.long)))
        return out

    def micro_batches(self, micro_batch_size: int) -> list["RolloutBatch"]:
        """Consecutive micro-batches of ``micro_batch_size`` rows (the last may be smaller)."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [self.select(slice(i, i + micro_batch_size)) for i in range(0, self.batch_size, micro_batch_size)]

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """input_ids, position_ids and the explicit causal bool attention mask [b,1,s,s]
        (True = masked) that megatron's local attention takes on CPU."""
        b, s = self.input_ids.shape
        dev = self.input_ids.device
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=dev), diagonal=1)
        return {
            "input_ids": self.input_ids,
            "position_ids": torch.arange(s, dtype=torch.long, device=dev).unsqueeze(0).expand(b, s),
            "attention_mask": causal.view(1, 1, s, s).expand(b, 1, s, s),
        }


def routed_experts_tensor(samples: Sequence, width: int) -> torch.Tensor | None:
    """``[B, width, moe_layers, topk]`` long of the samples' ``routed_experts`` (-1 where a sample has
    none, and on padding); None when no sample has them."""
    have = [s.routed_experts for s in samples if getattr(s, "routed_experts", None)]
    if not have:
        return None
    layers, k = len(have[0][0]), len(have[0][0][0])
    out = torch.full((len(samples), width, layers, k), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        if getattr(s, "routed_experts", None):
            e = torch.as_tensor(s.routed_experts, dtype=torch.long)
            out[i, :e.shape[0]] = e
    return out
