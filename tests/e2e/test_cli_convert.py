"""`megarl convert` as a user runs it (subprocesses): a trained policy leaves megarl as an HF folder.

- a LocalTrainer takes an optimizer step and saves a training checkpoint; `megarl convert
  mcore-to-hf --mcore <run>/checkpoints` writes an HF folder whose tensors equal the trainer's
  weights exactly, which loads in transformers (model + tokenizer, offline) and reproduces the
  trainer's logprobs;
- training checkpoints saved at TP=2 and at PP=2 (tied embeddings) by 2 ranks export exactly;
- hf-to-mcore (TP=2) then mcore-to-hf is an exact round trip through the CLI;
- wrong paths (missing, not a checkpoint, truncated, an old checkpoint without its HF config) are
  one line on stderr with exit code 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.utils.dist import run_multiprocess

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore",
           PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _cli(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl", *map(str, args)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (
        f"rc={r.returncode}, want 2 and one line\nstderr:\n{r.stderr}")
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from megarl.trainer.convert import HFReader

    r = HFReader(folder)
    return {k: r(k) for k in r.names()}


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k] - want[k]).abs().max()}"


def _perturbed_copy(src: Path, dst: Path, seed: int) -> Path:
    """An HF folder like src with every tensor moved by noise (the "trained" weights)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (v + 0.02 * torch.randn(v.shape, generator=g)).to(v.dtype).contiguous()
               for k, v in _safetensors(src).items()}
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ----------------------------------------------------------------------- TP=1: a real LocalTrainer

def test_export_local_trainer_checkpoint(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.config import load_config
    from megarl.batch import RolloutBatch
    from megarl.trainer.local import LocalTrainer
    from megarl.trainer.logprobs import compute_logprobs

    cfg = load_config(REPO / "configs" / "tiny_test.yaml",
                      [f"model.path={tiny_llama_dir}", "trainer.lr=1e-3", "trainer.micro_batch_size=2"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 4000, (2, 12), generator=g).tolist()
    batch = RolloutBatch.from_sequences(tokens, [[0.0] * 4 + [1.0] * 8] * 2,
                                        behav_logprobs=[[-6.0] * 12] * 2, advantages=[1.0, -1.0],
                                        versions=[[0] * 12] * 2)
    run = tmp_path / "run"
    trainer = LocalTrainer(cfg.trainer, cfg.algorithm, tiny_llama_dir, total_steps=2, run_dir=run)
    try:
        trainer.step(batch)
        trained = {k: v.detach().clone() for k, v in trainer.hf_weights()}
        trainer_lp = compute_logprobs(trainer.model, batch, temperature=1.0).logprobs
        step_dir = trainer.save()
    finally:
        trainer.close()
    initial = _safetensors(tiny_llama_dir)
    assert set(trained) == set(initial)
    assert all(not torch.equal(trained[k], initial[k]) for k in trained)  # the step moved every weight
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["export"]["hf_config"]["model_type"] == "llama"
    assert (step_dir / "hf_extra" / "tokenizer.json").is_file()

    out = tmp_path / "hf"
    r = _cli("convert", "mcore-to-hf", "--mcore", run / "checkpoints", "--out", out)
    _ok(r)
    assert f"HF folder: {out}" in r.stdout
    _assert_same_tensors(_safetensors(out), trained)

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert next(model.parameters()).dtype == torch.float32
    sd = model.state_dict()
    for k, v in trained.items():
        assert torch.equal(sd[k], v), k
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("1 + 1 =")["input_ids"]
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = model(ids).logits.float()
        initial_logits = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()(ids).logits.float()
    assert torch.isfinite(logits).all()
    # Adam step 1 moves each weight by ~lr = 1e-3 (sign of g): a logit row by ~lr * sum|h| ~ 0.1
    assert (logits - initial_logits).abs().max() > 1e-2  # the exported model is the trained one
    hf_lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    gap = (hf_lp - trainer_lp[:, 1:]).abs().max().item()
    # both fp32, other kernels: the 1e-4 logit-rounding bound of test_trainer_model.py would do; 2e-3 is 20x looser
    assert gap < 2e-3, f"HF logprobs differ from the trainer's by {gap}"


# ----------------------------------------------------------------------- TP=2 and PP=2, 2 ranks

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def _save_multirank(rank: int, world_size: int, sources: dict, root: str) -> None:
    """For each layout: a model at that TP/PP with the source's weights, megatron DDP + optimizer +
    scheduler as in training, saved as a training checkpoint with its export metadata."""
    from megarl.trainer.checkpoint import TrainProgress, save_checkpoint
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.models.layouts import ModelDims
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.optimizer import build_training
    from megarl.utils.dist import init_model_parallel

    for name, (tp, pp) in LAYOUTS.items():
        src = sources[name]
        init_model_parallel(tp, pp, seed=0)
        model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(src)), init_weights=False)
        load_hf_into_model(model, src)
        cfg = TrainerConfig(tp=tp, pp=pp, dp=world_size // (tp * pp), micro_batch_size=1, lr=1e-3,
                            use_distributed_optimizer=False)  # a DistributedOptimizer cannot save before a step
        objs = build_training(cfg, model, total_steps=4)
        save_checkpoint(Path(root) / name / "checkpoints", model=objs.model, optimizer=objs.optimizer,
                        scheduler=objs.scheduler, progress=TrainProgress(step=3, consumed_samples=6),
                        hf_config=read_hf_config(src), hf_extra_from=src)


@pytest.fixture(scope="module")
def multirank_runs(tiny_llama_dir, tiny_llama_tied_dir, tmp_path_factory):
    """Training checkpoints of perturbed tiny models at TP=2 (untied) and PP=2 (tied), 2 ranks."""
    root = tmp_path_factory.mktemp("multirank")
    sources = {"tp2": _perturbed_copy(tiny_llama_dir, root / "src_tp2", seed=1),
               "pp2": _perturbed_copy(tiny_llama_tied_dir, root / "src_pp2", seed=2)}
    run_multiprocess(_save_multirank, 2, {k: str(v) for k, v in sources.items()}, str(root), timeout_s=240)
    return root, sources


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_export_multirank_training_checkpoint(multirank_runs, name, tmp_path):
    root, sources = multirank_runs
    step = root / name / "checkpoints" / "step_00000003"
    meta = json.loads((step / "meta.json").read_text())
    tp, pp = LAYOUTS[name]
    assert (meta["parallel"]["tp"], meta["parallel"]["pp"]) == (tp, pp)
    # a step folder for tp2, the run folder (-> checkpoints/latest) for pp2
    target = step if name == "tp2" else root / name
    out = tmp_path / "hf"
    _ok(_cli("convert", "mcore-to-hf", "--mcore", target, "--out", out))
    _assert_same_tensors(_safetensors(out), _safetensors(sources[name]))
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in sources[name].iterdir())
    if name == "pp2":  # tied: no lm_head in the folder, and transformers ties it back
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out).eval()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[1, 504, 3180, 314]])).logits).all()


def test_old_training_checkpoint_needs_hf(multirank_runs, tmp_path, tiny_llama_dir):
    """A step folder saved without the export metadata (older megarl): one-line error naming --hf;
    with --hf it exports; an --hf of another architecture is refused."""
    root, sources = multirank_runs
    old = tmp_path / "old" / "step_00000003"
    shutil.copytree(root / "tp2" / "checkpoints" / "step_00000003", old)
    meta = json.loads((old / "meta.json").read_text())
    meta.pop("export")
    meta["files"] = {k: v for k, v in meta["files"].items() if not k.startswith("hf_extra/")}
    shutil.rmtree(old / "hf_extra")
    (old / "meta.json").write_text(json.dumps(meta))
    _one_line_error(_cli("convert", "mcore-to-hf", "--mcore", old, "--out", tmp_path / "a"), "--hf")
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (other / "config.json").write_text(json.dumps(cfg))
    _one_line_error(_cli("convert", "mcore-to-hf", "--mcore", old, "--out", tmp_path / "b", "--hf", other),
                    "num_layers")
    out = tmp_path / "hf"
    _ok(_cli("convert", "mcore-to-hf", "--mcore", old, "--out", out, "--hf", tiny_llama_dir))
    _assert_same_tensors(_safetensors(out), _safetensors(sources["tp2"]))
    assert (out / "tokenizer.json").is_file()
    # inside a run folder (as `megarl train` leaves it) the run's config.yaml names the model
    run = tmp_path / "run"
    shutil.copytree(old, run / "checkpoints" / old.name)
    (run / "checkpoints" / "latest").write_text(old.name)
    (run / "config.yaml").write_text(f"name: run\nmodel:\n  path: {tiny_llama_dir}\n")
    out = tmp_path / "hf_from_run"
    _ok(_cli("convert", "mcore-to-hf", "--mcore", run, "--out", out))
    _assert_same_tensors(_safetensors(out), _safetensors(sources["tp2"]))
    assert (out / "tokenizer.json").is_file()


# ----------------------------------------------------------------------- hf-to-mcore round trip

@pytest.fixture(scope="module")
def converted(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_mcore") / "mcore"
    r = _cli("convert", "hf-to-mcore", "--hf", tiny_llama_dir, "--out", out, "--tp", "2")
    _ok(r)
    assert "tp=2" in r.stdout
    return out


def test_hf_to_mcore_to_hf_round_trip(converted, tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    _ok(_cli("convert", "mcore-to-hf", "--mcore", converted, "--out", out))
    _assert_same_tensors(_safetensors(out), _safetensors(tiny_llama_dir))
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert AutoTokenizer.from_pretrained(out)("hello")["input_ids"]


# ----------------------------------------------------------------------- wrong input: one line, rc 2

def test_wrong_paths_are_one_line_errors(multirank_runs, converted, tiny_llama_dir, tmp_path, capsys):
    root, _ = multirank_runs
    step = root / "tp2" / "checkpoints" / "step_00000003"
    empty = tmp_path / "empty"
    empty.mkdir()
    truncated = tmp_path / "truncated" / "step_00000003"
    shutil.copytree(step, truncated)
    shard = next(truncated.glob("dist/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    missing_file = tmp_path / "missing_file" / "step_00000003"
    shutil.copytree(step, missing_file)
    (missing_file / "rng" / "rank_00000.pt").unlink()
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "latest").write_text("step_00000099")
    trunc_model = tmp_path / "trunc_model"
    shutil.copytree(converted, trunc_model)
    shard = next(trunc_model.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    busy_out = tmp_path / "busy"
    busy_out.mkdir()
    (busy_out / "x").write_text("x")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    run_no_latest = tmp_path / "run_no_latest"
    (run_no_latest / "checkpoints").mkdir(parents=True)

    m2h = ("convert", "mcore-to-hf", "--out", tmp_path / "out", "--mcore")
    hf_missing = ("convert", "hf-to-mcore", "--hf", tmp_path / "nope", "--out", tmp_path / "o1")
    cases = {  # args -> words the one line must contain
        (*m2h, tmp_path / "nope"): ("does not exist", "step_XXXXXXXX"),
        (*m2h, empty): ("not a megarl checkpoint", "hf-to-mcore"),
        (*m2h, tiny_llama_dir): ("HF folder",),
        (*m2h, truncated): ("damaged", ".distcp"),
        (*m2h, missing_file): ("incomplete", "rank_00000.pt"),
        (*m2h, dangling): ("step_00000099",),
        (*m2h, trunc_model): ("damaged", ".distcp"),
        (*m2h, run_no_latest): ("no complete checkpoint", "latest"),
        ("convert", "mcore-to-hf", "--mcore", step, "--out", busy_out): ("not empty", "--out"),
        hf_missing: ("--hf", "does not exist"),
        ("convert", "hf-to-mcore", "--hf", no_config, "--out", tmp_path / "o2"): ("--hf", "config.json"),
        ("convert", "hf-to-mcore", "--hf", tiny_llama_dir, "--out", tmp_path / "o3", "--tp", "3"): ("tp=3",),
        ("convert", "gguf-to-hf", "--gguf", tmp_path / "nope.gguf", "--out", tmp_path / "o4"): ("--gguf",),
    }
    # three as a user runs them (own interpreter); the rest through the same entry point in-process
    as_user = [(*m2h, tmp_path / "nope"), (*m2h, truncated), hf_missing]
    procs = {args: subprocess.Popen([sys.executable, "-m", "megarl", *map(str, args)], cwd=REPO, env=ENV,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in as_user}
    for args, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        _one_line_error(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), *cases[args])
    from megarl.cli import main

    for args in cases:
        rc = main([str(a) for a in args])
        captured = capsys.readouterr()
        _one_line_error(subprocess.CompletedProcess(args, rc, captured.out, captured.err), *cases[args])
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------- gguf-to-hf

@pytest.mark.slow  # dequantizes SmolLM2-135M: 48 s on 2 busy cores (near the 60 s bar; -m slow)
def test_gguf_to_hf_cli(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smol"
    from megarl.models.smollm2 import smollm2_gguf_path

    r = _cli("convert", "gguf-to-hf", "--gguf", smollm2_gguf_path(), "--out", out, "--dtype", "bfloat16", timeout=600)
    _ok(r)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([tok("2 + 2 =")["input_ids"]])).logits
    assert torch.isfinite(logits.float()).all()
