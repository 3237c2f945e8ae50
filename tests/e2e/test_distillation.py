"""On-policy distillation (issue 43 step 4): algorithm.teacher / algorithm.distill_coef.

The teacher's per-token reverse KL log pi - log q enters the advantage (megarl/algorithms/distill.py);
distill/reverse_kl is its mean over reply tokens; a teacher identical to the student gives 0 at fp32;
a teacher with another tokenizer is refused in one line.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from megarl.algorithms.config import AlgorithmConfig, needs_teacher
from megarl.algorithms.policy_loss import policy_loss
from megarl.config.teacher import teacher_problems, tokenizer_mismatch

LN = math.log


def _inputs(teacher):
    # one sequence, position 0 the prompt (masked), two reply tokens with pi = mu = (0.5, 0.25)
    lp = torch.tensor([[0.0, LN(0.5), LN(0.25)]], dtype=torch.float32, requires_grad=True)
    mu = torch.tensor([[0.0, LN(0.5), LN(0.25)]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    return dict(logprobs=lp, behav_logprobs=mu, advantages=torch.tensor([1.0]), mask=mask,
                teacher_logprobs=torch.tensor([[0.0] + teacher]))


def test_hand_computed_loss_with_teacher_term():
    # teacher q = (0.25, 0.25): k = (ln 2, 0); coef 0.5 -> A' = (1 - 0.5 ln 2, 1)
    inp = _inputs([LN(0.25), LN(0.25)])
    loss, m = policy_loss("aipo", distill_coef=0.5, **inp)
    # aipo with pi = mu: weight 1, per token -A' log pi; token-mean over 2 tokens
    a1, a2 = 1 - 0.5 * LN(2), 1.0
    want = (-a1 * LN(0.5) - a2 * LN(0.25)) / 2
    # float32 arithmetic on values of order 1: a few ulps (2**-23 ~ 1.2e-7) of relative error
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["distill/reverse_kl"] == pytest.approx(LN(2) / 2, rel=1e-6)
    loss.backward()
    # d/d log pi of -sg(w) A' log pi / 2, the teacher term detached (REINFORCE, not a pathwise KL grad)
    assert inp["logprobs"].grad.tolist()[0] == pytest.approx([0.0, -a1 / 2, -a2 / 2], rel=1e-6)
    # planted break check: without the term the loss differs (the reference is not the plain loss)
    plain, _ = policy_loss("aipo", **{k: v for k, v in inp.items() if k != "teacher_logprobs"})
    assert plain.item() != pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("loss", ["aipo", "ppo", "grpo", "vaco", "sao"])
def test_teacher_equal_to_student_gives_zero_kl_and_the_plain_loss(loss):
    torch.manual_seed(0)
    lp = torch.randn(3, 6).clamp(max=-0.1)
    mask = torch.ones(3, 6)
    mask[:, 0] = 0
    common = dict(logprobs=lp.clone().requires_grad_(), behav_logprobs=lp + 0.05 * torch.randn(3, 6),
                  advantages=torch.tensor([1.0, -0.5, 2.0]), mask=mask)
    with_teacher, m = policy_loss(loss, distill_coef=1.0, teacher_logprobs=lp.clone(), **common)
    plain, _ = policy_loss(loss, **common)
    assert m["distill/reverse_kl"] == 0.0  # bit-identical logprobs: exactly 0 at fp32
    assert with_teacher.item() == plain.item()


def test_distill_coef_needs_teacher_logprobs():
    inp = _inputs([LN(0.25), LN(0.25)])
    del inp["teacher_logprobs"]
    with pytest.raises(ValueError, match="teacher_logprobs"):
        policy_loss("aipo", distill_coef=1.0, **inp)


def test_config_knobs():
    assert not needs_teacher(AlgorithmConfig())
    assert needs_teacher(AlgorithmConfig(teacher="/t", distill_coef=1.0))
    with pytest.raises(ValueError, match="distill_coef=1.0 needs algorithm.teacher"):
        AlgorithmConfig(distill_coef=1.0)
    with pytest.raises(ValueError, match="algorithm.distill_coef=-1.0 is out of range"):
        AlgorithmConfig(teacher="/t", distill_coef=-1.0)
    with pytest.raises(ValueError, match="algorithm.teacher='/t' is used only with algorithm.distill_coef > 0"):
        AlgorithmConfig(teacher="/t")


def test_mismatched_tokenizer_refused_in_one_line(tiny_llama_dir, tmp_path):
    same = tmp_path / "same"
    shutil.copytree(tiny_llama_dir, same)
    assert tokenizer_mismatch(tiny_llama_dir, same) is None
    algo = AlgorithmConfig(teacher=str(same), distill_coef=1.0)
    assert teacher_problems(algo, tiny_llama_dir) == []

    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|im_start|>"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    problems = teacher_problems(AlgorithmConfig(teacher=str(other), distill_coef=1.0), tiny_llama_dir)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert "vocab: 49152 vs 49152 tokens, 2 differ" in problems[0]
    assert "eos_token '<|im_end|>' vs '<|im_start|>'" in problems[0]
    assert problems[0].startswith(f"algorithm.teacher={str(other)!r}: its tokenizer is not model.path's")


# ---------------------------------------------------------------- the teacher executor (real Megatron ranks)

def _batch():
    from megarl.batch import RolloutBatch

    tokens = [[1, 5, 9, 13, 17, 21], [1, 7, 11, 15]]
    masks = [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1]]
    return RolloutBatch.from_sequences(tokens, masks, advantages=[0.0, 0.0])


def test_teacher_executor_logprobs_and_its_death_names_it(tiny_llama_dir, tmp_path):
    import os
    import signal

    from megarl.teacher.executor import TeacherExecutor, TeacherFailed
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.local import LocalTrainer

    algo = AlgorithmConfig(teacher=str(tiny_llama_dir), distill_coef=1.0)
    cfg = TrainerConfig(micro_batch_size=4, params_dtype="float32", checkpoint_interval=0)
    batch = _batch()
    with TeacherExecutor(cfg, algo, tiny_llama_dir, run_dir=tmp_path) as teacher:
        filled = teacher.fill(batch)
        # the reference: the policy's own logprob code on the same weights, in this process, on as many
        # intra-op threads as the teacher's one rank runs (trainer/worker.py _pin: every allowed core),
        # since a reduction split another way is no longer bit-identical (torch's default count ignores
        # the affinity; the two differ on SMT or containerised hosts)
        threads = torch.get_num_threads()
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        local = LocalTrainer(cfg, AlgorithmConfig(), tiny_llama_dir, total_steps=1, run_dir=tmp_path / "policy")
        try:
            want = local.logprobs(batch)
        finally:
            local.close()
            torch.set_num_threads(threads)
        m = batch.loss_mask.bool()
        assert bool((want[m] != 0).all())  # the reference is not 0
        assert torch.equal(filled.teacher_logprobs[m], want[m])  # the same code and weights: bit-identical at fp32
        assert (tmp_path / "teacher" / "logs" / "trainer_rank0.log").is_file()
        os.kill(teacher.pids[0], signal.SIGKILL)
        with pytest.raises(TeacherFailed) as err:
            teacher.fill(batch)
    text = str(err.value)
    assert text.startswith("teacher: teacher rank 0 (tp 0, pp 0, dp 0; pid"), text[:200]
    assert "was killed by signal SIGKILL" in text and "teacher rank" in err.value.component


# ---------------------------------------------------------------- placement, memory plan, recipe (pure)

RECIPE = "configs/recipes/distill_qwen25_05b_from_15b_gsm8k.yaml"


def _layout_cfg(**over):
    from megarl.config.schema import MegaRLConfig

    cfg = MegaRLConfig()
    values = {"trainer.tp": 2, "trainer.dp": 1, "generator.tp": 1, "generator.replicas": 2,
              "algorithm.teacher": "/t", "algorithm.distill_coef": 1.0, **over}
    for key, value in values.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_placement_gives_the_teacher_its_own_gpus():
    from megarl.config.placement import device_plan

    plan = device_plan(_layout_cfg(), visible=8)
    assert plan.trainer == [0, 1] and plan.generator == [2, 3] and plan.teacher == [4, 5]
    assert plan.note.endswith("teacher ranks on GPU(s) 4,5")
    shared = device_plan(_layout_cfg(**{"cluster.share_devices": True}), visible=2)
    assert shared.teacher == shared.trainer == [0, 1]
    with pytest.raises(ValueError, match=r"the distillation teacher \(algorithm.teacher\) needs 2 GPU\(s\)"):
        device_plan(_layout_cfg(), visible=5)
    assert device_plan(_layout_cfg(**{"algorithm.teacher": None, "algorithm.distill_coef": 0.0}), 8).teacher is None


def test_memory_plan_has_a_teacher_line_against_hand_figures():
    from megarl.config import load_config
    from megarl.config.dry_run import dry_run_report

    cfg = load_config(RECIPE, [], dry_run=True)
    lines, problems = dry_run_report(cfg)
    text = "\n".join(lines)
    assert problems == [] and "teacher, per GPU:" in text, text
    # Qwen2.5-1.5B (configs/models/qwen2.5-1.5b-instruct.json): 1,543,714,304 parameters (tied embeddings;
    # vocab 151936 is a multiple of 128: no padding), bf16 2 B each = 3.087 GB
    assert "weights              3.09 GB" in text.split("teacher, per GPU:")[1]
    # logits: one micro-batch of 8 x (512 + 512) tokens x 151936 vocab x (2 B bf16 + 4 B fp32 copy) = 7.468 GB
    assert "logits               7.47 GB" in text.split("teacher, per GPU:")[1]


def test_recipe_validates_with_the_teacher():
    from megarl.config import load_config

    cfg = load_config(RECIPE, [], dry_run=True)
    assert cfg.algorithm.teacher == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.algorithm.distill_coef == 1.0
    # under Slurm the teacher is a rank pool of its own (tests/unit/test_slurm_rank_pools.py): no refusal
    assert load_config(RECIPE, ["cluster.launcher=slurm"], dry_run=True).cluster.launcher == "slurm"


# ---------------------------------------------------------------- a short real job (megarl train)

def _job(model_dir, out_dir, teacher, *overrides):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "megarl", "train", str(repo / "configs" / "tiny_test.yaml"), f"model.path={model_dir}",
           f"logging.out_dir={out_dir}", "controller.eval_every=0", "trainer.checkpoint_interval=0",
           f"algorithm.teacher={teacher}", "algorithm.distill_coef=1.0", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=repo,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    rows = []
    metrics = Path(out_dir) / "tiny-test" / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return out, rows


def test_job_with_teacher_logs_reverse_kl(tiny_llama_dir, tmp_path):
    from megarl.models.tiny import make_tiny_hf_checkpoint

    # 1) teacher == student: the teacher's ranks and the trainer run the same logprob code on the same fp32
    #    weights, so at step 1 (the trainer still holds the initial weights) log pi - log q is exactly 0
    out, rows = _job(tiny_llama_dir, tmp_path / "same", tiny_llama_dir, "controller.steps=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert rows[0]["step"] == 1 and rows[0]["distill/reverse_kl"] == 0.0
    assert rows[0]["train/loss/distill/reverse_kl"] == 0.0
    assert "starting the teacher (forward-only Megatron" in out.stdout
    # every executor launches before the first is awaited (megarl/controller/startup.py: start_together)
    lines = out.stdout.splitlines()
    at = lambda text: next(i for i, line in enumerate(lines) if text in line)  # noqa: E731
    assert at("starting the teacher") < at("trainer: 1 rank(s) ready") < at("teacher: 1 rank(s) ready"), out.stdout
    # 2) another teacher (same tokenizer, other random weights): the tiny model's rewards are all equal (every
    #    reply cut at max_new_tokens), so the GRPO advantage is 0 and only the teacher's term moves the policy
    other = make_tiny_hf_checkpoint(tmp_path / "other_teacher", "llama", seed=7)
    out, rows = _job(tiny_llama_dir, tmp_path / "other", other, "controller.steps=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    kl = rows[0]["distill/reverse_kl"]
    assert kl != 0.0 and math.isfinite(kl)  # the reference is not 0
    assert rows[0]["reward/correct_frac"] == 0.0 and rows[0]["train/grad_norm"] > 0.0


def test_teacher_death_stops_the_job_naming_it(tiny_llama_dir, tmp_path):
    # MEGARL_FAULT_INJECT=teacher_exit: the teacher's rank exits (code 9) when asked for its first logprobs
    import os

    os.environ["MEGARL_FAULT_INJECT"] = "teacher_exit"
    try:
        out, rows = _job(tiny_llama_dir, tmp_path, tiny_llama_dir, "controller.steps=1")
    finally:
        del os.environ["MEGARL_FAULT_INJECT"]
    assert out.returncode != 0 and rows == []
    last = out.stderr.strip().splitlines()[-1]
    assert "teacher: teacher rank 0 (tp 0, pp 0, dp 0; pid" in last and "exited with code 9" in last, out.stderr[-2000:]
