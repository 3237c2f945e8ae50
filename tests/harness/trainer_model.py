"""Trainer-model test machinery: a sample batch and transformers' logits/logprobs for it."""

from __future__ import annotations

import torch

from megarl.batch import RolloutBatch


def _sample_batch(vocab: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [12, 7, 10, 5]  # 4 rows: split over DP=2 and DP=4
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 3 + [1.0] * (n - 3) for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks)


def _hf_logits(hf_dir, batch: RolloutBatch, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    model.eval()
    with torch.no_grad():
        attn = (torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]).long()
        return model(input_ids=batch.input_ids, attention_mask=attn).logits


def _hf_logprobs(logits: torch.Tensor, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    lp = torch.log_softmax(logits[:, :-1].double() / temperature, -1)
    out = lp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1).float()
    out = torch.nn.functional.pad(out, (1, 0))
    from megarl.trainer.logprobs import valid_token_mask
    return out * valid_token_mask(batch)
