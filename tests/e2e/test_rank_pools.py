"""The teacher's and the critic's rank pools under the Slurm launcher (issue 43), run as local processes by
`megarl launch local` (the same role map and `megarl rank` commands srun runs): one job with a distillation
teacher and a GAE critic, each rank its own OS process that attached to the controller over TCP from its own
simulated node, in a process group of its own. About 60-90 s each on 2 cores. And `megarl rank --role
teacher|critic` refuses a task the job's map does not have or srun placed elsewhere."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
# Bounds: test_rendezvous's tiny 2-step job (trainer + generator) took 43 s end to end on 2 shared cores;
# a teacher and a critic add two Megatron executors (their start and one forward / update each step), so
# 600 s is generous and still below the executors' own start and step timeouts (a hang fails the test).
JOB_TIMEOUT_S = 600
TEARDOWN_S = 20  # cluster.teardown_timeout_s: test_rendezvous's figure (a tiny step is ~1 s)
# reward.truncated=-1: every tiny reply is cut at max_new_tokens and scores -1, so GRPO's advantage is 0
# and only the critic's (V near 0 at start) and the teacher's term move the policy (test_critic_executor).
ROLES = ["algorithm.advantage=gae", "reward.truncated=-1", "critic.head_init_std=0.05", "algorithm.gae_lambda=0.9",
         "critic.lr=1e-3", "algorithm.distill_coef=1.0"]


def _cmd(model_dir: Path, out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megarl", "launch", "local", str(REPO / "configs" / "tiny_test.yaml"),
            f"model.path={model_dir}", f"logging.out_dir={out}", f"algorithm.teacher={model_dir}",
            "controller.eval_every=0", "trainer.checkpoint_interval=0", f"cluster.teardown_timeout_s={TEARDOWN_S}",
            *ROLES, *overrides, "--log-dir", str(out / "tasks")]


def _pids(launcher_out: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (.+?): pid (\d+)", launcher_out)}


def _alive(pids, timeout_s: float = 15.0) -> list[int]:
    """The pids still alive after up to ``timeout_s`` (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_teacher_and_critic_pools_run_a_job_as_their_own_processes(tiny_llama_dir, tmp_path):
    out = subprocess.run(_cmd(tiny_llama_dir, tmp_path, "controller.steps=2"), capture_output=True, text=True,
                         timeout=JOB_TIMEOUT_S, cwd=REPO)
    ctrl = (tmp_path / "tasks" / "controller.log").read_text()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + ctrl[-3000:]
    # the map: each pool on its own simulated node, outside the DDMA world
    assert "MEGARL_WORLD_SIZE=2 (trainer 1 + generator 1) + teacher pool 1 rank(s) + critic pool 1 rank(s)" in out.stdout
    assert re.search(r"teacher pool:\s+sim1 ", out.stdout) and re.search(r"critic pool:\s+sim2 ", out.stdout)
    assert "--role teacher" in out.stdout and "--role critic" in out.stdout  # their srun lines
    pids = _pids(out.stdout)
    assert set(pids) == {"controller", "trainer rank 0", "teacher rank 0", "critic rank 0", "generator replica 0"}
    for role in ("trainer", "teacher", "critic"):  # each rank attached over TCP at its role's own port
        assert re.search(rf"{role}: rank 0 attached from pid {pids[f'{role} rank 0']}\b", ctrl), (role, ctrl[-3000:])
    rows = [json.loads(line) for line in (tmp_path / "tiny-test" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # teacher == student at fp32 (tiny_test.yaml): step 1's reverse KL is exactly 0 (test_distillation's reason),
    # so the teacher's ranks scored the trainer's own samples with the same weights
    assert rows[0]["distill/reverse_kl"] == 0.0 and rows[1]["distill/reverse_kl"] != 0.0
    for r in rows:  # every reward is -1: the critic's advantages alone give the policy a gradient
        assert r["reward/correct_frac"] == 0.0 and r["train/grad_norm"] > 0.0
        assert math.isfinite(r["critic/value_loss"]) and r["critic/value_loss"] > 0.0
    assert rows[1]["critic/value_loss"] < rows[0]["critic/value_loss"]  # the critic learned (lr 1e-3)
    for role in ("teacher", "critic"):
        assert "rank 0" in (tmp_path / "tiny-test" / role / "logs" / "trainer_rank0.log").read_text()
    assert not _alive(pids.values())


def test_a_killed_critic_rank_stops_the_job_naming_it(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "launcher.out"
    with open(log_path, "w") as f:
        proc = subprocess.Popen(_cmd(tiny_llama_dir, tmp_path, "controller.steps=200"), stdout=f,
                                stderr=subprocess.STDOUT, cwd=REPO)
    metrics = tmp_path / "tiny-test" / "metrics.jsonl"
    family: set[int] = set()
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().strip():
                break
            time.sleep(0.2)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert metrics.exists(), "no step finished in time"
        family = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        victim = _pids(log_path.read_text())["critic rank 0"]
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    launcher = log_path.read_text()
    ctrl = (tmp_path / "tasks" / "controller.log").read_text()
    assert code != 0, launcher[-3000:]
    assert "critic rank 0 was killed by signal SIGKILL" in launcher, launcher[-3000:]  # the launcher names it
    # the controller names the critic's rank (coordinates, pid) and the cause, not "trainer rank"
    assert re.search(rf"critic rank 0 \(tp 0, pp 0, dp 0; pid {victim} on \S+\) lost its connection", ctrl), ctrl[-3000:]
    last = launcher.strip().splitlines()[-1]  # the job's last line names the critic, as a local job's does
    assert last.startswith("megarl: critic: critic rank 0 (tp 0, pp 0, dp 0;") and "CriticFailed" in last, last
    assert not _alive(family | {proc.pid}), "processes left behind"


def test_a_task_of_a_role_the_job_lacks_is_refused(tiny_llama_dir):
    from megarl.cluster.rank import run_task

    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_GPUS_ON_NODE": "8",
           "SLURMD_NODENAME": "node02", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    # a task validates the config for real: the tiny checkpoint is student and teacher (test_slurm's GPU cluster
    # simulated on this host: cluster.device=cuda, DDMA over p2p between the nodes)
    over = ["cluster.launcher=slurm", "cluster.device=cuda", "sync.transport=p2p", f"model.path={tiny_llama_dir}",
            f"algorithm.teacher={tiny_llama_dir}", "algorithm.distill_coef=1.0", "trainer.dp=8",
            "generator.replicas=8", "data.train_path=builtin:arithmetic", "data.eval_path=builtin:arithmetic"]
    quickstart = str(REPO / "configs" / "quickstart.yaml")
    with pytest.raises(ConfigError, match="--role critic: this job has no critic"):
        run_task("critic", quickstart, over, env=env)
    # a teacher task placed where the map says another goes (the teacher's rank 0 is node02's local 0)
    with pytest.raises(ConfigError, match="srun placed teacher task 0 on node03 as local task 0, but the role map "
                                          "expects node02 local 0"):
        run_task("teacher", quickstart, over, env={**env, "SLURMD_NODENAME": "node03"})
