"""megarl.cluster.slurm: the distillation teacher's and the critic's rank pools (issue 43). Their nodes sit
between the trainer's and the generator's, their ranks spread like the trainer's, each pool meets at its own
rendezvous and channel ports (inside the job's port slot, never another job's), their srun lines start
`megarl rank --role teacher|critic`, misfits name the knob to change, the dry run counts them. Pure: no process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cluster.slurm import (PORT_FLOOR, PORT_SLOTS, PORTS_PER_JOB, AllocationError, SlurmEnv, build_role_map,
                                  job_ports, role_ports)
from megarl.config import load_config

REPO = Path(__file__).resolve().parents[2]
DISTILL = str(REPO / "configs" / "recipes" / "distill_qwen25_05b_from_15b_gsm8k.yaml")  # trainer tp1 pp1 dp1
NODES = "node[01-04]"


def _env(nodelist: str = NODES, gpus: int = 8, job: int = 4242, **extra: str) -> SlurmEnv:
    return SlurmEnv.from_env({"SLURM_JOB_ID": str(job), "SLURM_JOB_NODELIST": nodelist, "SLURM_GPUS_ON_NODE": str(gpus),
                              **extra})


def _cfg(*overrides: str):
    # the distillation recipe planned without its weights here (dry_run), multi-node: DDMA over nccl
    return load_config(DISTILL, ["cluster.launcher=slurm", "trainer.dp=8", "generator.replicas=8", *overrides],
                       dry_run=True)


def _both(*overrides: str):
    """Distillation and a GAE critic at dp 4 in one job: 1 trainer + 1 teacher + 1 critic + 1 generator node."""
    return _cfg("algorithm.advantage=gae", "critic.dp=4", *overrides)


def test_pools_sit_between_the_trainer_and_the_generator():
    rmap = build_role_map(_env(SLURM_JOB_CPUS_PER_NODE="96(x4)"), _both())
    assert rmap.trainer_pool.nodes == ("node01",) and rmap.generator_pool.nodes == ("node04",)
    teacher, critic = rmap.rank_pool("teacher"), rmap.rank_pool("critic")
    assert [p.role for p in rmap.rank_pools] == ["teacher", "critic"]
    assert teacher.pool.nodes == ("node02",) and critic.pool.nodes == ("node03",)
    # the teacher runs at the trainer's layout (8 ranks), the critic at its own (critic.dp=4)
    assert teacher.world == 8 and critic.world == 4
    assert [(r.rank, r.node, r.local_rank, r.device) for r in critic.ranks] == [(i, "node03", i, i) for i in range(4)]
    assert [r.detail for r in critic.ranks[:2]] == ["critic rank 0: tp 0 pp 0 dp 0", "critic rank 1: tp 0 pp 0 dp 1"]
    # outside the DDMA world: MEGARL_WORLD_SIZE is still trainer + generator workers
    assert rmap.world_size == 16 and rmap.job_env()["MEGARL_WORLD_SIZE"] == "16"
    assert teacher.pool.cpus_per_task == 96 // 8 and critic.pool.cpus_per_task == 96 // 4
    text = rmap.format()
    assert ("4 node(s), 32 GPU(s); MEGARL_WORLD_SIZE=16 (trainer 8 + generator 8) + teacher pool 8 rank(s) + "
            "critic pool 4 rank(s)") in text
    assert "teacher pool:   node02  (8 rank(s) per node" in text and "critic pool:    node03  (4 rank(s)" in text


def test_each_pool_has_its_own_ports_and_srun_line():
    rmap = build_role_map(_env(job=1001), _both())
    teacher, critic = rmap.rank_pool("teacher"), rmap.rank_pool("critic")
    ports = [*job_ports(1001), teacher.master_port, teacher.channel_port, critic.master_port, critic.channel_port]
    assert len(set(ports)) == len(ports) == PORTS_PER_JOB  # every port of the slot, each used once
    assert (teacher.master_port, teacher.channel_port) == role_ports(1001, "teacher")
    # the slot never reaches the next job's, nor Linux's ephemeral range (32768+)
    assert max(ports) < job_ports(1002)[0] and PORT_FLOOR + PORT_SLOTS * PORTS_PER_JOB <= 32768
    env = rmap.job_env()
    assert env["MEGARL_TEACHER_PORT"] == str(teacher.channel_port)
    assert (env["MEGARL_TEACHER_MASTER_ADDR"], env["MEGARL_TEACHER_MASTER_PORT"]) == ("node02", str(teacher.master_port))
    assert (env["MEGARL_CRITIC_MASTER_ADDR"], env["MEGARL_CRITIC_PORT"]) == ("node03", str(critic.channel_port))
    lines = rmap.srun_lines(["megarl"], "c.yaml", [])
    assert list(lines) == ["controller", "trainer", "teacher", "critic", "generator"]  # the controller starts first
    assert lines["critic"][:6] == ["srun", "--job-name=megarl-critic", "--nodes=1", "--ntasks=4", "--ntasks-per-node=4",
                                   "--nodelist=node03"]
    assert lines["teacher"][-4:] == ["rank", "--role", "teacher", "c.yaml"]
    # a job without them has neither pool nor their variables
    plain = build_role_map(_env("node[01-02]"), _cfg("algorithm.distill_coef=0", "algorithm.teacher="))
    assert plain.rank_pools == () and "MEGARL_TEACHER_PORT" not in plain.job_env()
    assert list(plain.srun_lines(["megarl"], "c.yaml", [])) == ["controller", "trainer", "generator"]


def test_pool_sizes_follow_their_knobs():
    # two teacher nodes of 4 ranks each: the teacher's 8 ranks spread block-wise
    rmap = build_role_map(_env("n[1-4]"), _cfg("cluster.teacher_nodes=2"))
    assert rmap.rank_pool("teacher").pool.nodes == ("n2", "n3") and rmap.generator_pool.nodes == ("n4",)
    assert [r.node for r in rmap.rank_pool("teacher").ranks] == ["n2"] * 4 + ["n3"] * 4


@pytest.mark.parametrize("nodelist, overrides, expect", [
    ("n[1-2]", (), "cluster.trainer_nodes=1 (derived) + cluster.teacher_nodes=1 (derived) + "
                   "cluster.generator_nodes=1 (derived) = 3; submit with --nodes=3"),
    ("n[1-5]", ("cluster.teacher_nodes=3",), "the teacher's 8 rank(s) (the trainer's tp*pp*dp) do not spread "
                                             "evenly over 3 teacher node(s); change cluster.teacher_nodes"),
    ("n[1-4]", ("algorithm.advantage=gae", "critic.dp=4", "cluster.critic_nodes=1", "cluster.ranks_per_node=2",
                "trainer.dp=2", "generator.replicas=2", "cluster.trainer_nodes=1", "cluster.teacher_nodes=1"),
     "the critic's 4 rank(s) (critic's tp*pp*dp) need 4 per node on 1 node(s), but a node holds 2; raise "
     "cluster.critic_nodes to 2"),
    ("n[1-3]", ("cluster.teacher_nodes=-1",), "cluster.teacher_nodes=-1: must be >= 0"),
], ids=["too-few-nodes", "uneven", "too-many-per-node", "negative"])
def test_misfits_name_the_knob(nodelist, overrides, expect):
    with pytest.raises(AllocationError) as err:
        build_role_map(_env(nodelist), _cfg(*overrides))
    assert expect in str(err.value)


def test_a_heterogeneous_job_has_no_pool_for_them():
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST_HET_GROUP_0": "t1",
                             "SLURM_JOB_NODELIST_HET_GROUP_1": "g1", "SLURM_GPUS_PER_NODE_HET_GROUP_0": "8",
                             "SLURM_GPUS_PER_NODE_HET_GROUP_1": "8"})
    with pytest.raises(AllocationError, match="a heterogeneous job has no node pool for the teacher: submit one "
                                              "homogeneous allocation"):
        build_role_map(env, _cfg())


def test_a_cpu_dry_run_counts_processes_not_gpus():
    """On the CPU a rank is a process (before: "2 GPUs: ... 8 GPUs a node" and "memory plan: none
    (cluster.device is not cuda)" for a CPU job)."""
    from megarl.config.dry_run import dry_run_report

    tiny = str(REPO / "configs" / "tiny_test.yaml")
    lines, problems = dry_run_report(load_config(tiny, ["cluster.device=cpu"], dry_run=True))
    assert problems == [] and "GPU" not in lines[0], lines
    assert lines[0] == ("ranks: trainer tp1 x pp1 x dp1 = 1, generator tp1 x 1 replica(s) = 1; 2 processes on this "
                        "machine's CPUs, trainer and generator side by side (launcher local)")
    assert lines[-1] == ("memory plan: none: it plans each GPU's memory, and this job runs on the CPU "
                         "(cluster.device=cpu), its 2 processes sharing this machine's memory")
    lines, _ = dry_run_report(load_config(tiny, ["cluster.device=cpu", "cluster.launcher=slurm",
                                                 "cluster.ranks_per_node=2"], dry_run=True))
    assert lines[0].endswith("; 2 processes: 1 trainer + 1 generator node(s) (launcher slurm), 2 ranks a node "
                             "(cluster.ranks_per_node)"), lines[0]
    assert lines[-1].endswith("its 2 processes sharing their nodes' memory"), lines[-1]


def test_the_dry_run_counts_every_role_and_their_pools():
    from megarl.config.dry_run import dry_run_report

    local = load_config(DISTILL, ["algorithm.advantage=gae"], dry_run=True)
    line = dry_run_report(local)[0][0]
    # 1 trainer + 1 generator + 1 teacher (the trainer's layout) + 1 critic (its own: the trainer's) GPUs
    assert line.startswith("ranks: trainer tp1 x pp1 x dp1 = 1, generator tp1 x 1 replica(s) = 1, distillation "
                           "teacher 1, critic 1; 4 GPUs: 1 node(s), trainer and generator and teacher and critic "
                           "side by side (launcher local)"), line
    line = dry_run_report(_both())[0][0]  # trainer dp 8, 8 replicas, teacher 8, critic dp 4, 8 GPUs a node
    assert ("distillation teacher 8, critic 4; 28 GPUs: 1 trainer + 1 teacher + 1 critic + 1 generator node(s) "
            "(launcher slurm)") in line, line
