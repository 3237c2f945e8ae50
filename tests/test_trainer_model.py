"""Megatron GPTModel built from HF configs: logits vs transformers, logprobs across TP/PP,
checkpoint conversion round trips, clear errors."""

from __future__ import annotations

import pytest
import torch

from megarl.trainer.batch import RolloutBatch
from megarl.utils.dist import MultiprocessError, run_multiprocess


def _sample_batch(vocab: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [12, 7, 10]
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 3 + [1.0] * (n - 3) for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks)


def _hf_logits(hf_dir, batch: RolloutBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
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


def _model_worker(rank, world, tp, pp, source, kind, batch, temperature, want_logits):
    """Build at (tp, pp), load weights from an HF dir (kind='hf') or a Megatron checkpoint ('mcore')."""
    from megarl.trainer.convert import load_hf_into_model, load_model_checkpoint, read_meta
    from megarl.trainer.layouts import ModelDims
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(tp, pp, seed=123)
    cfg = read_hf_config(source) if kind == "hf" else read_meta(source)["hf_config"]
    model = build_gpt_model(ModelDims.from_hf_config(cfg))
    if kind == "hf":
        load_hf_into_model(model, source)
    else:
        load_model_checkpoint(model, source)
    out = {"logprobs": compute_logprobs(model, batch, micro_batch_size=2, temperature=temperature,
                                        with_entropy=True)}
    if want_logits:  # TP=1 PP=1 only: the full (padded) vocab is local
        with torch.no_grad():
            out["logits"] = model(**batch.model_inputs())
    return out


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_tied_dir"])
def test_logits_match_transformers(fixture, request):
    hf_dir = request.getfixturevalue(fixture)
    batch = _sample_batch(49152)
    ref = _hf_logits(hf_dir, batch)
    (res,) = run_multiprocess(_model_worker, 1, 1, 1, str(hf_dir), "hf", batch, 1.0, True, timeout_s=300)
    valid = torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]
    ours = res["logits"][..., :ref.shape[-1]]
    assert (ours - ref)[valid].abs().max() < 1e-4
    assert torch.allclose(res["logprobs"].logprobs, _hf_logprobs(ref, batch), atol=1e-4)
    # entropy of the real vocab only: the padded columns must not leak in
    p = torch.softmax(ref.double(), -1)
    ent = -(p * torch.log(p)).sum(-1)[:, :-1].float()
    from megarl.trainer.logprobs import valid_token_mask
    assert torch.allclose(res["logprobs"].entropy, torch.nn.functional.pad(ent, (1, 0)) * valid_token_mask(batch),
                          atol=1e-4)
