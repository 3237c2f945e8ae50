"""PPO with a critic (issue 43 step 2): algorithm.advantage gae|vtrace runs a value model's executor.

Real jobs (`megarl train` on configs/tiny_test.yaml): the critic's values give per-token advantages that
move the policy where GRPO's would be 0, its value loss falls and is logged with explained variance and
clip fraction, its checkpoint sits beside the trainer's and a resumed job continues it at the trainer's
step; a critic rank's death stops the job naming the critic. Without a job: the validation messages,
the device plan, the memory plan's critic block, the recipe, the executor's refusals.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/recipes/ppo_gae_qwen25_05b_gsm8k.yaml"
# The tiny random model's replies are all cut at max_new_tokens: reward.truncated=-1 gives every one -1, so
# GRPO's advantages are 0 while the critic's (V starts near 0) are not; lambda 0.9 makes the returns depend
# on the values, so their variance (explained_var's denominator) is not 0.
CRITIC = ["algorithm.advantage=gae", "reward.truncated=-1", "critic.head_init_std=0.05", "algorithm.gae_lambda=0.9",
          "critic.lr=1e-3"]


def _job(model_dir, out_dir, *overrides, env=None):
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"), f"model.path={model_dir}",
           f"logging.out_dir={out_dir}", "controller.eval_every=0", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    metrics = Path(out_dir) / "tiny-test" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return out, rows


def test_job_trains_a_critic_and_resumes_it_with_the_trainer(tiny_llama_dir, tmp_path):
    out, rows = _job(tiny_llama_dir, tmp_path, *CRITIC, "controller.steps=2", "trainer.checkpoint_interval=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting the critic (value model, Megatron tp=1 pp=1 dp=1, lr 0.001" in out.stdout
    # every executor launches before the first is awaited (megarl/controller/startup.py: start_together)
    lines = out.stdout.splitlines()
    at = lambda text: next(i for i, line in enumerate(lines) if text in line)  # noqa: E731
    assert at("starting the critic") < at("trainer: 1 rank(s) ready") < at("critic: 1 rank(s) ready"), out.stdout
    ready = lines[at("executors ready in")]  # one line: each role's seconds from the first launch
    assert all(f"{role} " in ready for role in ("trainer", "generator", "critic")) and "started together" in ready
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/mean"] == -1.0  # every reply truncated: GRPO's advantages would all be 0
        loss = r["critic/value_loss"]
        assert math.isfinite(loss) and loss > 0.0
        assert math.isfinite(r["critic/explained_var"]) and r["critic/clip_frac"] == 0.0  # one update: no clip yet
        assert r["critic/advantage_abs_mean"] > 0.1  # -1 - V with V near 0: the critic's advantages reach...
        assert r["train/grad_norm"] > 0.0  # ...the policy, which moves (with GRPO here it would not)
        assert r["critic/updates"] == 1.0 and r["time/critic"] > 0.0
    # values near 0 against returns near -1: the update moves them there (lr 1e-3), the loss falls
    assert rows[1]["critic/value_loss"] < rows[0]["critic/value_loss"]
    run = tmp_path / "tiny-test"
    assert (run / "critic" / "logs" / "trainer_rank0.log").is_file()
    critic_dir = run / "checkpoints" / "critic"
    assert sorted(p.name for p in critic_dir.glob("step_*")) == ["step_00000001", "step_00000002"]

    # resume (trainer.resume_from=auto): the critic loads its step-2 checkpoint; a fresh critic would
    # count its one update as step 1 and save step_00000001 again
    out, rows = _job(tiny_llama_dir, tmp_path, *CRITIC, "controller.steps=3", "trainer.checkpoint_interval=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3] and math.isfinite(rows[2]["critic/value_loss"])
    # trainer.keep_checkpoints=2 keeps 3 critic steps (it saves first: test_the_critic_keeps_every_step_...)
    assert sorted(p.name for p in critic_dir.glob("step_*")) == ["step_00000001", "step_00000002", "step_00000003"]
    meta = json.loads((critic_dir / "step_00000003" / "meta.json").read_text())
    # the optimizer came back too: Adam's step count and the samples continue from step 2's (8 rows a step)
    assert (meta["step"], meta["adam_step"], meta["consumed_samples"]) == (3, 3, 24)
    assert f"resuming from {critic_dir / 'step_00000002'}" in out.stdout


def test_critic_death_stops_the_job_naming_it(tiny_llama_dir, tmp_path):
    # MEGARL_FAULT_INJECT=critic_exit: the critic's rank exits (code 9) when asked for its first values
    out, rows = _job(tiny_llama_dir, tmp_path, *CRITIC, "controller.steps=1", "trainer.checkpoint_interval=0",
                     env={"MEGARL_FAULT_INJECT": "critic_exit"})
    assert out.returncode != 0 and rows == []
    last = out.stderr.strip().splitlines()[-1]
    assert "critic: critic rank 0 (tp 0, pp 0, dp 0; pid" in last and "exited with code 9" in last, out.stderr[-2000:]
    assert "answer: the critic's values" in last and "CriticFailed" in last
    assert f"its own log: {tmp_path / 'tiny-test' / 'critic' / 'logs' / 'trainer_rank0.log'}" in last


def test_vtrace_job_with_the_critic_at_its_own_tp(tiny_llama_dir, tmp_path):
    # V-trace asks the policy for log pi of the batch (lag 0, fp32: pi = mu, its targets are GAE's returns);
    # the critic runs at tp 2 beside a tp 1 trainer: its own layout, not the trainer's
    over = [c.replace("advantage=gae", "advantage=vtrace") for c in CRITIC]
    out, rows = _job(tiny_llama_dir, tmp_path, *over, "critic.tp=2", "controller.steps=1", "trainer.checkpoint_interval=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "starting the critic (value model, Megatron tp=2 pp=1 dp=1" in out.stdout
    # its ready line names the critic at its own layout (the trainer's is "trainer: 1 rank(s) ready (tp 1 ...")
    assert "critic: 2 rank(s) ready (tp 2 x pp 1 x dp 1)" in out.stdout
    assert (tmp_path / "tiny-test" / "critic" / "logs" / "trainer_rank1.log").is_file()
    assert rows[0]["critic/value_loss"] > 0.0 and rows[0]["critic/advantage_abs_mean"] > 0.1
    assert math.isfinite(rows[0]["critic/explained_var"]) and rows[0]["train/grad_norm"] > 0.0


# ---------------------------------------------------------------- without a job

def _load(*overrides, dry_run=True):
    from megarl.config import load_config

    return load_config(RECIPE, list(overrides), dry_run=dry_run)


def _problems(*overrides):
    from megarl.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _load(*overrides)
    return info.value.problems


def test_validation_says_what_to_change():
    assert _load().critic.lr == 1.0e-5  # the recipe validates
    assert _problems("critic.tp=3") == ["critic.tp=3 does not divide the HF config num_attention_heads=14; use one of "
                                        "[1, 2, 7, 14]"]  # the trainer's rule (models/dims.py), the critic's key
    assert _problems("critic.dp=3") == [
        "critic.dp=3: a critic update's 64 sequences (controller.prompts_per_step=256 x generator.n_samples=1 / "
        "trainer.minibatches=4) do not split over 3 data-parallel critic ranks; set critic.dp=2 (0 = trainer.dp)"]
    assert _problems("critic.pp=-1") == ["critic.pp=-1: must be >= 0 (0 = the trainer's)"]
    assert _problems("critic.lr=0") == ["critic.lr=0.0: must be > 0 (the critic's learning rate)"]
    assert _load("cluster.launcher=slurm").critic.lr == 1.0e-5  # under Slurm: a rank pool of its own, no refusal


def test_a_missing_critic_path_is_refused(tiny_llama_dir, tmp_path):
    from megarl.config import ConfigError, load_config

    base = [f"model.path={tiny_llama_dir}", "algorithm.advantage=gae"]
    assert load_config("configs/tiny_test.yaml", base).critic.path == ""
    assert load_config("configs/tiny_test.yaml", base + [f"critic.path={tiny_llama_dir}"]).critic.path
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny_test.yaml", base + [f"critic.path={tmp_path}"])
    assert info.value.problems == [
        f"critic.path={str(tmp_path)!r}: neither an HF model folder (config.json) nor a megarl checkpoint "
        f"(`megarl convert hf-to-mcore`'s, a training step folder, a checkpoint folder with 'latest', or a run "
        f"folder); point it at the value model's starting weights, or set critic.path='' to start from model.path"]
    # another tokenizer: the critic would value other token ids (the teacher's check, megarl/config/teacher.py)
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    tok = json.loads((other / "tokenizer_config.json").read_text())
    tok["eos_token"] = "<|im_start|>"
    (other / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny_test.yaml", base + [f"critic.path={other}"])
    assert info.value.problems == [
        f"critic.path={str(other)!r}: its tokenizer is not model.path's (special tokens: eos_token '<|im_end|>' vs "
        f"'<|im_start|>'); the critic values the policy's token ids, so start it from a model with the policy's tokenizer"]
    # without gae/vtrace the critic: section is not read
    assert load_config("configs/tiny_test.yaml", [f"model.path={tiny_llama_dir}", f"critic.path={tmp_path}"])


def test_placement_gives_the_critic_its_own_gpus():
    from megarl.cluster.slurm import placement_lines
    from megarl.config.placement import device_plan

    cfg = _load()
    plan = device_plan(cfg, visible=3)
    assert plan.trainer == [0] and plan.generator == [1] and plan.critic == [2]
    assert plan.note.endswith("critic ranks on GPU(s) 2")
    assert device_plan(_load("critic.dp=2"), visible=4).critic == [2, 3]
    with pytest.raises(ValueError, match=r"the critic \(algorithm.advantage=gae\) needs 2 GPU\(s\)"):
        device_plan(_load("critic.dp=2"), visible=3)
    assert device_plan(_load("cluster.share_devices=true"), visible=1).critic == [0]
    assert device_plan(_load("algorithm.advantage=grpo"), visible=3).critic is None
    assert "critic GPU(s) 2" in placement_lines(cfg, 3, "n1")[0]
    assert "critic" not in placement_lines(_load("algorithm.advantage=grpo"), 3, "n1")[0]


def test_memory_plan_has_a_critic_block_against_hand_figures():
    from megarl.config.dry_run import dry_run_report

    lines, problems = dry_run_report(_load())
    text = "\n".join(lines)
    assert problems == [] and "critic, per GPU:" in text, text
    critic = text.split("critic, per GPU:")[1]
    # Qwen2.5-0.5B (configs/models/qwen2.5-0.5b.json): 494,032,768 parameters (tied; vocab 151936 = 128 x 1187),
    # bf16 2 B = 0.988 GB; fp32 main grads 4 B = 1.976 GB; Adam m, v and the fp32 master 12 B = 5.928 GB (dp 1)
    assert "weights              0.99 GB" in critic and "gradients            1.98 GB" in critic
    assert "optimizer            5.93 GB" in critic
    assert "logits" not in critic  # a scalar head: one value a token, where the policy keeps 14.9 GB of logits
    trainer = text.split("trainer, per GPU:")[1].split("generator, per GPU:")[0]
    act = [ln for ln in trainer.splitlines() if "activations" in ln]
    assert act and act[0].strip() in critic  # the same micro-batch at the same layout
    assert "critic" not in "\n".join(dry_run_report(_load("algorithm.advantage=grpo"))[0])


def test_the_executor_refuses_what_it_cannot_run(tiny_llama_dir, tmp_path):
    from megarl.algorithms.config import AlgorithmConfig
    from megarl.critic.config import CriticConfig
    from megarl.critic.executor import CriticExecutor, critic_resume
    from megarl.trainer.config import TrainerConfig
    from megarl.utils.checkpoint_store import CheckpointError

    gae = AlgorithmConfig(advantage="gae")
    with pytest.raises(ValueError, match="needs algorithm.advantage gae or vtrace"):
        CriticExecutor(TrainerConfig(), CriticConfig(), AlgorithmConfig(), tiny_llama_dir, run_dir=tmp_path, total_steps=1)
    # resume: a run that never had a critic starts it fresh; a critic folder without the trainer's step is refused
    assert critic_resume(tmp_path / "none", 4) is None and critic_resume(tmp_path, 0) is None
    step = tmp_path / "critic" / "step_00000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    assert critic_resume(tmp_path / "critic", 2) == step
    with pytest.raises(CheckpointError, match=r"resumes at step 4 but .* holds steps \[2\]"):
        critic_resume(tmp_path / "critic", 4)


@pytest.mark.parametrize("async_save,keep", [(False, 1), (False, 2), (True, 2), (True, 3)])
def test_the_critic_keeps_every_step_the_trainer_may_resume_at(tmp_path, async_save, keep):
    """The critic saves step N before the trainer, and prunes its own folder: at the trainer's count
    (the old rule) a kill during the trainer's save of N (or, async, while N-1's write was in flight)
    left the trainer resuming at a step whose critic was already deleted: CheckpointError, no resume.
    Real prune and critic_resume on step folders; every step the trainer may still resume at must
    have its critic."""
    from megarl.critic.config import CriticConfig
    from megarl.critic.executor import CriticRanksConfig, critic_resume
    from megarl.trainer.config import TrainerConfig
    from megarl.utils.checkpoint_store import META, prune, step_dir_name

    ranks = CriticRanksConfig.of(TrainerConfig(keep_checkpoints=keep, async_save=async_save), CriticConfig(),
                                 run_root=str(tmp_path), resume_from=None)
    folder = tmp_path / "critic"
    folder.mkdir()
    lag = 2 if async_save else 1  # saves by which the trainer's newest committed step trails the critic's
    for n in range(1, 9):  # the critic saves step n, pruned as its rank 0 prunes it
        saved = folder / step_dir_name(n)
        saved.mkdir()
        (saved / META).write_text("{}")
        prune(folder, saved, ranks.keep_checkpoints)
        newest = n - lag  # a kill now: the trainer keeps `keep` steps up to this one, and may resume at any
        for step in range(max(1, newest - keep + 1), newest + 1):
            assert critic_resume(folder, step) == folder / step_dir_name(step), (n, step)
