"""critic.path pointing at a megarl checkpoint (issue 43): the value model starts from an `hf_to_mcore`
checkpoint or from a training checkpoint (a run folder, its checkpoints' `latest`) with the body those weights
hold, the same values as from an HF folder of the same weights. In real Megatron ranks (run_multiprocess:
fresh processes) after one real `megarl train` step that writes the training checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from megarl.batch import RolloutBatch
from megarl.utils.dist import run_multiprocess

REPO = Path(__file__).resolve().parents[2]


def _values(rank, world, paths, batch):
    from megarl.critic.model import build_value_model, compute_values
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(1, 1, seed=123)
    # the same head seed for each: only the body's weights may differ
    return [compute_values(build_value_model(p, head_init_std=0.02, seed=1), batch, micro_batch_size=2) for p in paths]


def test_critic_starts_from_megarl_checkpoints_as_from_hf_folders(tiny_llama_dir, tmp_path):
    from megarl.trainer.convert import hf_to_mcore, mcore_to_hf

    converted = hf_to_mcore(tiny_llama_dir, tmp_path / "mcore", tp=1, pp=1, params_dtype="float32")
    # a training checkpoint: one step of the tiny job (fp32, tiny_test.yaml), saved
    job = subprocess.run([sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
                          f"model.path={tiny_llama_dir}", f"logging.out_dir={tmp_path}", "controller.steps=1",
                          "controller.eval_every=0", "trainer.checkpoint_interval=1", "algorithm.entropy_coef=0.01"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    run = tmp_path / "tiny-test"
    trained_hf = mcore_to_hf(run / "checkpoints", tmp_path / "trained_hf")  # fp32 written exactly (convert.py)
    g = torch.Generator().manual_seed(0)
    lengths = (9, 12)
    batch = RolloutBatch.from_sequences([torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths],
                                        [[0.0] * 3 + [1.0] * (n - 3) for n in lengths])
    paths = [tiny_llama_dir, converted, trained_hf, run, run / "checkpoints"]
    # 600 s: test_critic_model's bound for one rank building tiny value models on a loaded machine
    hf, from_converted, hf_trained, from_run, from_ckpt_dir = run_multiprocess(
        _values, 1, [str(p) for p in paths], batch, timeout_s=600)[0]
    mask = batch.loss_mask.bool()
    assert hf[mask].abs().sum() > 0  # the reference is not 0 (head N(0, 0.02))
    # fp32 on one rank, the same weights in the same modules: bit for bit
    assert torch.equal(from_converted, hf)
    assert torch.equal(from_run, hf_trained) and torch.equal(from_ckpt_dir, hf_trained)
    # the control: the step moved the body (entropy bonus: a gradient although every tiny reward is equal),
    # so the equalities above are about which weights were loaded
    assert not torch.equal(hf_trained[mask], hf[mask])
