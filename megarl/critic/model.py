"""The value model: the policy's Megatron GPTModel with a scalar head, its forward and its update.

:func:`build_value_model` builds the trainer's GPTModel for this rank's TP/PP layout (megarl/trainer/
model.py), loads a checkpoint into it (the policy's HF folder or a megarl Megatron checkpoint:
``critic.path``, default the policy's weights) and, on the last PP stage, puts a :class:`ValueHead`
(hidden -> 1) where the vocabulary projection was. Megatron's schedules then run it unchanged:
``run_pipeline`` hands ``[b, s, 1]`` "logits" to the loss callback. Values are aligned like the
logprobs (megarl/batch.py): ``values[b, t]`` is V of the prefix ``< t``, read at position t - 1.

:func:`compute_values` and :func:`critic_update` are collective over the critic's ranks like
``compute_logprobs`` / ``train_update`` (every rank the same global batch; DP ranks each take their
rows); the update minimises megarl/critic/value_loss.py's clipped loss with the optimizer
``build_training`` makes (its own LR: the critic's TrainerConfig).
"""

from __future__ import annotations

import torch

from megarl.batch import RolloutBatch


class ValueHead(torch.nn.Module):
    """hidden -> scalar, replicated on every TP rank (the final norm's output is whole on each), in
    the place and call convention of GPTModel's ``output_layer`` (returns ``(out, bias)``)."""

    def __init__(self, hidden: int, dtype: torch.dtype = torch.float32, init_std: float = 0.0, seed: int = 0):
        super().__init__()
        weight = torch.zeros(1, hidden, dtype=dtype)
        if init_std > 0:
            weight.normal_(0.0, init_std, generator=torch.Generator().manual_seed(seed))
        self.weight = torch.nn.Parameter(weight)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # weight: GPTModel passes the shared embedding when embeddings are tied; the head is its own
        return torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype)), None


def build_value_model(path, *, params_dtype: torch.dtype = torch.float32, head_init_std: float = 0.0,
                      seed: int = 0):
    """The value model for this rank (call after ``init_model_parallel``): the GPTModel of the
    weights at ``path`` (an HF folder, an ``hf_to_mcore`` checkpoint, or a training checkpoint: a step
    folder, a checkpoint dir's ``latest``, a run folder; megarl/trainer/convert.py weights_source), its LM
    head dropped, with a :class:`ValueHead` (weights N(0, head_init_std); 0: every value
    starts at 0). Carries ``megarl_value_model = True``."""
    from megatron.core import parallel_state as ps

    from megarl.models.layouts import ModelDims
    from megarl.trainer.convert import weights_source
    from megarl.trainer.local import set_tp_attributes
    from megarl.trainer.model import build_gpt_model

    source = weights_source(path)  # an HF folder, an hf_to_mcore checkpoint or a training checkpoint
    dims = ModelDims.from_hf_config(source.hf_config)
    model = build_gpt_model(dims, params_dtype=params_dtype, init_weights=False,
                            vocab_divisible_by=source.vocab_divisible_by)
    set_tp_attributes(model)
    source.load_into(model)  # the body; its LM head is replaced below
    if ps.is_pipeline_last_stage():
        model.output_layer = ValueHead(dims.hidden_size, params_dtype, head_init_std, seed)
    model.megarl_value_model = True
    return model


def _aligned(out: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
    """``[b, s, 1]`` head output -> ``[b, s]`` values: V of prefix < t at t (position t - 1's output),
    zero at position 0 and on padding."""
    from megarl.trainer.logprobs import valid_token_mask

    v = out.squeeze(-1).float()
    v = torch.nn.functional.pad(v[:, :-1], (1, 0))
    return v * valid_token_mask(mb).to(v.device)


@torch.no_grad()
def compute_values(model, batch: RolloutBatch, *, micro_batch_size: int = 8) -> torch.Tensor:
    """Values ``[B, S]`` of ``batch`` on every rank (DP ranks compute their rows and exchange)."""
    from megatron.core import parallel_state as ps

    from megarl.trainer.logprobs import broadcast_from_last_stage, dp_rows, micro_batch_rows, run_pipeline

    dp = ps.get_data_parallel_world_size()
    shares = dp_rows(batch, False) if dp > 1 else [torch.arange(batch.batch_size)]
    local = batch.select(shares[ps.get_data_parallel_rank()] if dp > 1 else shares[0])
    rows = micro_batch_rows(local, micro_batch_size)
    was_training = model.training
    model.eval()
    try:
        results = run_pipeline(model, [local.select(r) for r in rows],
                               lambda mb, out, layout=None: (torch.zeros(()), {"values": _aligned(out, mb)}),
                               forward_only=True)
    finally:
        model.train(was_training)
    s = batch.input_ids.shape[1]
    mine = torch.zeros(local.batch_size, s)
    for res, r in zip(results, rows):  # last stage only
        mine[r, :res["values"].shape[1]] = res["values"].cpu()
    mine = broadcast_from_last_stage(mine)
    if dp == 1:
        return mine
    parts = [torch.empty_like(mine) for _ in range(dp)]
    torch.distributed.all_gather(parts, mine, group=ps.get_data_parallel_group())
    return torch.cat(parts)


def critic_update(objs, batch: RolloutBatch, old_values: torch.Tensor, targets: torch.Tensor, *,
                  value_clip: float | None, micro_batch_size: int) -> dict:
    """One optimizer update of the value model (``objs``: ``build_training``'s) on ``batch`` towards
    ``targets`` ``[B, S]``, clipped around ``old_values`` (the values the advantages were computed
    with). The loss is normalised by the global batch's loss tokens, so it does not depend on
    micro-batch size or DP. Returns ``critic/value_loss`` (the whole batch's, before the update),
    ``critic/clip_frac`` (the loss tokens whose clipped error was the larger), ``critic/grad_norm`` and
    ``critic/lr``."""
    import dataclasses

    from megatron.core import parallel_state as ps

    from megarl.critic.value_loss import value_loss
    from megarl.trainer.logprobs import dp_rows, micro_batch_rows, run_pipeline
    from megarl.trainer.optimizer import optimizer_step

    # old values and targets ride in the batch's spare per-token fields, so select() slices them alike
    full = dataclasses.replace(batch, prox_logprobs=old_values.float(), ref_logprobs=targets.float())
    denominator = max(float(batch.loss_mask.sum()), 1.0)
    local = full.select(dp_rows(full, False)[ps.get_data_parallel_rank()])
    micro = [local.select(r) for r in micro_batch_rows(local, micro_batch_size)]
    scale = len(micro) * ps.get_data_parallel_world_size()  # undo megatron's 1/num_mb and DDP's 1/dp
    total = torch.zeros(2, dtype=torch.float64)  # the loss, the clipped tokens

    def on_out(mb: RolloutBatch, out: torch.Tensor, layout=None):
        loss, m = value_loss(_aligned(out, mb), mb.prox_logprobs, mb.ref_logprobs, mb.loss_mask,
                             value_clip=value_clip, denominator=denominator)
        total.add_(torch.tensor([float(loss.detach()), m["critic/clip_frac"] * max(float(mb.loss_mask.sum()), 1.0)],
                                dtype=torch.float64))
        return loss * scale, {}

    (model,) = objs.model
    model.train()
    run_pipeline(model, micro, on_out, forward_only=False)
    if ps.is_pipeline_last_stage():
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group())
    from megarl.trainer.logprobs import broadcast_from_last_stage

    total = broadcast_from_last_stage(total)
    step = optimizer_step(objs, loss=float(total[0]))
    return {"critic/value_loss": float(total[0]), "critic/clip_frac": float(total[1]) / denominator,
            "critic/grad_norm": float(step.get("grad_norm", float("nan"))),
            "critic/lr": float(step.get("lr", float("nan")))}
