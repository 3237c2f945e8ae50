"""megarl.cluster.slurm: nodelists, the rank -> role map and srun lines from simulated Slurm
environments (2+1, 1+1, 4+1, 4+2 nodes of 8 GPUs, a heterogeneous job), job-scoped ports, CPUs per
task, and bad allocations failing with the knob to change. Pure: no process is started (the
dry-run CLI aside). The same scripts on a real Slurm cluster: tests/e2e/test_slurm_cluster.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cluster.slurm import (PORT_FLOOR, PORT_SLOTS, PORTS_PER_JOB, AllocationError, SlurmEnv, build_role_map,
                                  compress_nodelist, job_ports, parse_nodelist, pick_device)
from megarl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def _cfg(*overrides: str):
    # SmolLM2's shape (9 heads, 30 layers): tp in {1, 3}, pp divides 30. Multi-node needs DDMA over p2p.
    # A GPU cluster simulated on this CPU host: cluster.device=cuda (CPU-only knobs like the
    # quickstart's generator.threads_bind are then not checked).
    return load_config(QUICKSTART, ["sync.transport=p2p", "cluster.device=cuda", *overrides])


def _env(nodelist: str, gpus: int | None = 8, job: int = 4242, **extra: str) -> SlurmEnv:
    env = {"SLURM_JOB_ID": str(job), "SLURM_JOB_NODELIST": nodelist, **extra}
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return SlurmEnv.from_env(env)


def _problems(env: SlurmEnv, cfg) -> str:
    with pytest.raises(AllocationError) as err:
        build_role_map(env, cfg)
    return str(err.value)


def test_nodelist_parsing_and_compression():
    assert parse_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert parse_nodelist("a[1-2]b[8-9]") == ["a1b8", "a1b9", "a2b8", "a2b9"]
    assert parse_nodelist("n[098-101]") == ["n098", "n099", "n100", "n101"]  # the padding is the low end's
    assert parse_nodelist("solo") == ["solo"]
    for text in ("node[01-03,07],gpu5", "n[1-4,6,9-10]", "x,y,z"):
        assert parse_nodelist(compress_nodelist(parse_nodelist(text))) == parse_nodelist(text)
    assert compress_nodelist(["node01", "node02", "node03", "node07", "gpu5"]) == "node[01-03,07],gpu5"
    for bad in ("node[01-03", "node01]", "node[3-1]", "node[a-b]", "n1,n1"):
        with pytest.raises(ValueError):
            parse_nodelist(bad)


def test_env_reads_gpu_counts_restart_and_tmpdir():
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2",
                             "SLURM_GPUS_PER_NODE": "h100:4", "SLURM_RESTART_COUNT": "3", "TMPDIR": "/scratch/"})
    assert (env.nodes, env.gpus_per_node, env.restart_count) == (("n1", "n2"), 4, 3)
    rmap = build_role_map(env, _cfg("trainer.dp=4", "generator.replicas=4"))
    assert rmap.tmp_dir == "/scratch/megarl-7.3"  # job- and restart-scoped
    with pytest.raises(AllocationError, match="SLURM_NNODES=3"):
        SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "3"})
    with pytest.raises(AllocationError, match="sbatch launch/slurm/train.sbatch"):
        SlurmEnv.from_env({})


def test_two_trainer_nodes_one_generator_node():
    """The acceptance layout: 2 trainer nodes + 1 generator node, 8 GPUs each."""
    from megarl.trainer.executor import rank_coords

    cfg = _cfg("trainer.pp=2", "trainer.dp=8", "generator.replicas=8")
    rmap = build_role_map(_env("node[01-03]"), cfg)
    assert rmap.world_size == 24 and rmap.job_env()["MEGARL_WORLD_SIZE"] == "24"
    trainer = [r for r in rmap.ranks if r.role == "trainer"]
    gen = [r for r in rmap.ranks if r.role == "generator"]
    assert [r.node for r in trainer] == ["node01"] * 8 + ["node02"] * 8
    assert [r.local_rank for r in trainer] == [r.device for r in trainer] == list(range(8)) * 2
    for r in trainer:  # the executor's megatron order: pp is the slowest, so each node is one stage
        c = rank_coords(r.rank, 1, 2, 8)
        assert r.detail == f"tp {c['tp']} pp {c['pp']} dp {c['dp']}"
    assert {r.detail.split(" dp")[0] for r in trainer if r.node == "node02"} == {"tp 0 pp 1"}
    assert [(r.rank, r.node, r.device) for r in gen] == [(16 + i, "node03", i) for i in range(8)]
    assert (rmap.master_addr, rmap.controller_node, rmap.controller_addr) == ("node01", "node03", "node03")
    lines = rmap.srun_lines(["megarl"], "job.yaml", ["cluster.launcher=slurm"])
    t, c = lines["trainer"], lines["controller"]
    for flag in ("--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--nodelist=node[01-02]", "--gpus-per-node=8",
                 "--distribution=block", "--kill-on-bad-exit=1"):
        assert flag in t, (flag, t)
    for flag in ("--nodes=1", "--ntasks=1", "--nodelist=node03", "--overlap", "--kill-on-bad-exit=1"):
        assert flag in c, (flag, c)
    assert not any(a.startswith("--gpus") for a in c)  # the controller computes nothing; the replicas own the GPUs
    g = lines["generator"]
    for flag in ("--nodes=1", "--ntasks=8", "--ntasks-per-node=8", "--nodelist=node03", "--gpus-per-node=8"):
        assert flag in g, (flag, g)
    assert t[-5:] == ["rank", "--role", "trainer", "job.yaml", "cluster.launcher=slurm"]
    assert c[-5:] == ["rank", "--role", "controller", "job.yaml", "cluster.launcher=slurm"]
    assert g[-5:] == ["rank", "--role", "generator", "job.yaml", "cluster.launcher=slurm"]
    text = rmap.format()
    assert "MEGARL_WORLD_SIZE=24 (trainer 16 + generator 8)" in text and "trainer pool:   node[01-02]" in text


def test_one_plus_one_and_four_plus_one():
    rmap = build_role_map(_env("a,b"), _cfg("trainer.dp=8", "generator.replicas=8"))
    assert rmap.trainer_pool.nodes == ("a",) and rmap.generator_pool.nodes == ("b",) and rmap.world_size == 16
    assert "--ntasks=8" in rmap.srun_lines(["megarl"], "c", [])["trainer"]
    # 4 trainer nodes (32 ranks: pp 2 x dp 16) + 1 generator node; tp 3 x 2 replicas on it.
    rmap = build_role_map(_env("gpu[001-005]"), _cfg("trainer.pp=2", "trainer.dp=16", "generator.tp=3",
                                                       "generator.replicas=2"))
    assert rmap.trainer_world == 32 and rmap.world_size == 38
    assert [r.node for r in rmap.ranks[:32:8]] == ["gpu001", "gpu002", "gpu003", "gpu004"]
    assert rmap.controller_node == "gpu005"
    assert [r.detail for r in rmap.ranks[32:]] == [f"replica {i // 3} worker {i % 3}" for i in range(6)]
    assert "--nodelist=gpu[001-004]" in rmap.srun_lines(["megarl"], "c", [])["trainer"]


def test_the_generator_spans_nodes():
    """4 trainer nodes + 2 generator nodes: 4 TP2 replicas, 2 per generator node, each replica on
    GPUs [2 * local, +2) of its node; the controller beside the replicas on the first."""
    rmap = build_role_map(_env("n[1-6]", SLURM_JOB_CPUS_PER_NODE="64(x6)"),
                          _cfg("trainer.pp=2", "trainer.dp=16", "cluster.generator_nodes=2", "generator.tp=3",
                               "generator.replicas=4"))
    gen = [r for r in rmap.ranks if r.role == "generator"]
    assert [(r.node, r.device) for r in gen] == [("n5", d) for d in range(6)] + [("n6", d) for d in range(6)]
    assert [rmap.replica_node(i) for i in range(4)] == [("n5", 0), ("n5", 1), ("n6", 0), ("n6", 1)]
    assert rmap.controller_node == "n5" and rmap.generator_pool.nodes == ("n5", "n6")
    g = rmap.srun_lines(["megarl"], "c", [])["generator"]
    for flag in ("--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=n[5-6]", "--gpus-per-node=6",
                 "--cpus-per-task=30"):  # (64 CPUs - cluster.controller_cpus 4) / 2 replicas
        assert flag in g, (flag, g)
    assert "--cpus-per-task=4" in rmap.srun_lines(["megarl"], "c", [])["controller"]
    assert "--cpus-per-task=8" in rmap.srun_lines(["megarl"], "c", [])["trainer"]  # 64 CPUs / 8 ranks
    assert rmap.transport == "nccl"  # GPUs on other hosts: chosen from the placement (sync.transport=p2p there)
    assert build_role_map(_env("n[1-6]"), _cfg("trainer.pp=2", "trainer.dp=16", "cluster.device=cpu", "generator.replicas=2",
                                                "sync.transport=auto")).transport == "gloo"
    # replicas that do not spread evenly
    text = _problems(_env("n[1-6]"), _cfg("trainer.pp=2", "trainer.dp=16", "cluster.generator_nodes=2",
                                          "generator.replicas=3"))
    assert "multiple of 2" in text


def test_heterogeneous_job():
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "99", "SLURM_JOB_NODELIST": "t[1-2],g1",
                             "SLURM_JOB_NODELIST_HET_GROUP_0": "t[1-2]", "SLURM_JOB_NODELIST_HET_GROUP_1": "g1",
                             "SLURM_GPUS_PER_NODE_HET_GROUP_0": "8", "SLURM_GPUS_PER_NODE_HET_GROUP_1": "4"})
    rmap = build_role_map(env, _cfg("trainer.pp=2", "trainer.dp=8", "generator.replicas=4"))
    assert rmap.trainer_pool.nodes == ("t1", "t2") and rmap.controller_node == "g1" and rmap.world_size == 20
    lines = rmap.srun_lines(["megarl"], "c", [])
    assert "--het-group=0" in lines["trainer"] and "--het-group=1" in lines["controller"]
    assert "--het-group=1" in lines["generator"] and "--gpus-per-node=4" in lines["generator"]
    assert not any(a.startswith("--nodelist") for a in lines["trainer"] + lines["controller"] + lines["generator"])
    assert "heterogeneous job" in rmap.format()
    # a generator bigger than its het group's GPUs
    assert "lower generator.replicas to 4" in _problems(env, _cfg("trainer.pp=2", "trainer.dp=8",
                                                                   "generator.replicas=8"))


def test_job_scoped_ports():
    a, b = job_ports(1001), job_ports(1002)
    assert a != b and set(a).isdisjoint(b) and a == job_ports(1001)
    assert a[1] == a[0] + 1
    # every job slot lies below Linux's ephemeral range (32768+), so no outgoing connection takes it
    assert PORT_FLOOR <= min(job_ports(j)[0] for j in range(PORT_SLOTS))
    assert max(job_ports(j)[1] for j in range(PORT_SLOTS)) < 32768
    # jobs with nearby ids (the usual neighbours on a shared node) never share a port
    ports = [p for j in range(5000, 5000 + PORT_SLOTS) for p in job_ports(j)]
    assert len(ports) == len(set(ports))
    assert job_ports(5000 + PORT_SLOTS) == job_ports(5000)  # the documented wrap-around
    assert job_ports(1, port_base=40000) == (40000, 40001, 40002)
    assert PORTS_PER_JOB >= 3
    cfg = _cfg("trainer.dp=8", "generator.replicas=8")
    assert build_role_map(_env("a,b", job=1001), cfg).master_port != build_role_map(_env("a,b", job=1002),
                                                                                    cfg).master_port


@pytest.mark.parametrize("nodelist, gpus, overrides, expect", [
    ("n[1-4]", 8, ("trainer.pp=2", "trainer.dp=8", "cluster.generator_nodes=1"), "submit with --nodes=3"),
    ("n[1-2]", None, ("trainer.dp=8",), "cluster.ranks_per_node"),
    ("n[1-4]", 8, ("trainer.pp=2", "trainer.dp=8"), "generator.replicas=1 do not spread evenly over 2"),
    ("n[1-3]", 4, ("trainer.pp=2", "trainer.dp=8", "cluster.trainer_nodes=2"), "raise cluster.trainer_nodes to 4"),
    ("n[1-4]", 8, ("trainer.dp=4", "cluster.trainer_nodes=3"), "change trainer.dp or cluster.trainer_nodes"),
    ("n[1-2]", 8, ("trainer.dp=8", "generator.replicas=16"), "lower generator.replicas to 8"),
    ("n[1-2]", 8, ("trainer.dp=8", "cluster.device=cpu", "sync.transport=zero_copy"), "set sync.transport=auto"),
    ("n[1-2]", 8, ("trainer.dp=8", "cluster.controller_cpus=8"), "lower cluster.controller_cpus"),
    ("n[1-2]", 8, ("trainer.dp=8", "cluster.device=cuda", "cluster.trainer_devices=0-7"), "clear them"),
], ids=["nodes", "no-gpus", "generator-nodes", "too-many-per-node", "uneven", "generator-too-big", "zero-copy",
        "controller-cpus", "devices"])
def test_bad_allocations_name_what_to_change(nodelist, gpus, overrides, expect):
    cpus = f"8(x{len(parse_nodelist(nodelist))})"  # 8 CPUs a node: cluster.controller_cpus=8 leaves none
    assert expect in _problems(_env(nodelist, gpus, SLURM_JOB_CPUS_PER_NODE=cpus), _cfg(*overrides))


def test_cpus_per_node_parsing():
    from megarl.cluster.slurm import parse_cpus_per_node

    assert parse_cpus_per_node("72(x2),36") == [72, 72, 36]
    assert parse_cpus_per_node("8") == [8] and parse_cpus_per_node(None) == [] and parse_cpus_per_node("x") == []
    env = _env("n[1-3]", SLURM_JOB_CPUS_PER_NODE="72(x2),36")
    assert env.node_cpus(["n1", "n2"]) == 72 and env.node_cpus(["n2", "n3"]) == 36
    assert _env("n[1-3]").node_cpus(["n1"]) == 0  # unknown: the srun lines ask for no CPUs, and say so
    assert "no --cpus-per-task" in build_role_map(_env("n[1-3]"), _cfg("trainer.pp=2", "trainer.dp=8")).format()


def test_world_size_agrees_with_the_validator(monkeypatch):
    from megarl.config.validate import check

    cfg = _cfg("trainer.pp=2", "trainer.dp=8", "generator.replicas=8")
    rmap = build_role_map(_env("node[01-03]"), cfg)
    monkeypatch.setenv("MEGARL_WORLD_SIZE", rmap.job_env()["MEGARL_WORLD_SIZE"])
    assert not [p for p in check(cfg) if "world_size" in p]
    monkeypatch.setenv("MEGARL_WORLD_SIZE", "23")
    assert [p for p in check(cfg) if "world_size" in p]


def test_pick_device():
    assert pick_device("0,1,2,3,4,5,6,7", 5, 8) == "5"   # --gpus-per-node: every task sees the node's GPUs
    assert pick_device("3", 5, 8) == "3"                 # bound to one GPU by the site's config: keep it
    assert pick_device(None, 2, 8) == "2"
    assert pick_device("0,1", 0, 0) is None              # CPU pool
    with pytest.raises(AllocationError, match="--gpus-per-node=8"):
        pick_device("0,1", 5, 8)
    # a TP2 replica: local replica 1 takes the node's GPUs 2 and 3
    assert pick_device("0,1,2,3,4,5,6,7", 1, 8, count=2) == "2,3"
    assert pick_device("4,5", 1, 8, count=2) == "4,5" and pick_device(None, 3, 8, count=2) == "6,7"


def test_rank_entry_refuses_a_task_placed_elsewhere(tmp_path):
    from megarl.cluster.rank import run_task

    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_GPUS_ON_NODE": "8",
           "SLURMD_NODENAME": "node02", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
    over = ["sync.transport=p2p", "trainer.pp=2", "trainer.dp=8", "generator.replicas=8", "cluster.launcher=slurm"]
    with pytest.raises(ConfigError, match="--distribution=block"):
        run_task("trainer", QUICKSTART, over, env=env)
    with pytest.raises(ConfigError, match="cluster.launcher=slurm"):
        run_task("trainer", QUICKSTART, over[:-1], env=env)


def test_dry_run_prints_the_map_and_srun_lines():
    """`megarl launch slurm --dry-run` in a simulated 2+1 allocation (what docs/slurm.md shows)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_NNODES": "3",
                "SLURM_GPUS_ON_NODE": "8"})
    out = subprocess.run([sys.executable, "-m", "megarl", "launch", "slurm", QUICKSTART, "trainer.pp=2", "trainer.dp=8",
                          "generator.replicas=8", "sync.transport=p2p", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "MEGARL_WORLD_SIZE=24 (trainer 16 + generator 8)" in text
    assert "   15  trainer    node02           7      7  tp 0 pp 1 dp 7" in text
    assert "   16  generator  node03           0      0  replica 0 worker 0" in text
    assert "trainer: srun " in text and "controller: srun " in text and "generator: srun " in text
    assert "trainer.resume_from=auto" in text and "cluster.launcher=slurm" in text  # requeue-safe tasks
    # the same allocation with a node too few: exit 2 and the fix
    env["SLURM_JOB_NODELIST"], env["SLURM_NNODES"] = "node[01-02]", "2"
    out = subprocess.run([sys.executable, "-m", "megarl", "launch", "slurm", QUICKSTART, "trainer.pp=2",
                          "trainer.dp=8", "sync.transport=p2p", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert out.returncode == 2 and "--nodes=3" in out.stderr, out.stderr


def test_launcher_knobs_are_validated():
    with pytest.raises(ConfigError) as err:
        _cfg("cluster.generator_nodes=-1", "cluster.port_base=80", "cluster.ranks_per_node=-1",
             "cluster.teardown_timeout_s=0", "cluster.controller_cpus=0", "cluster.preempt_grace_s=0")
    text = str(err.value)
    for key in ("cluster.generator_nodes=-1", "cluster.port_base=80", "cluster.ranks_per_node=-1",
                "cluster.teardown_timeout_s=0", "cluster.controller_cpus=0", "cluster.preempt_grace_s=0"):
        assert key in text


def test_local_launcher_dry_run_uses_the_same_map(capsys):
    from megarl.cluster.launch import launch_local

    assert launch_local(QUICKSTART, ["trainer.dp=4"], trainer_nodes=2, dry_run=True) == 0
    text = capsys.readouterr().out
    assert "trainer pool:   sim[0-1]" in text and "generator pool: sim2" in text
    assert "MEGARL_WORLD_SIZE=5 (trainer 4 + generator 1)" in text and "MASTER_ADDR=127.0.0.1" in text
    assert "    3  trainer    sim1             1" in text


def test_placement_under_a_launcher_gives_the_generator_the_node():
    from megarl.config.placement import device_plan

    plan = device_plan(_cfg("trainer.pp=2", "trainer.dp=8", "generator.replicas=8", "cluster.launcher=slurm"), 8)
    assert plan.trainer is None and plan.generator == list(range(8))  # the trainer ranks are on other nodes


def test_attach_refuses_a_foreign_key_and_names_the_missing_rank():
    """The executor's listener: a client with another job's key is refused, a rank that never comes
    is named after the start timeout (3 s here: the test's own choice, nothing waits longer)."""
    import pickle
    import threading
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from megarl.cluster.launch import free_port_base
    from megarl.executors.attach import AttachError, AttachSpec, accept_ranks

    spec = AttachSpec(free_port_base(1), b"right-key", job_id="7")
    refused = []

    def clients():
        import time

        for _ in range(50):  # until the listener is up
            try:
                c = Client(("127.0.0.1", spec.port), authkey=b"wrong-key")
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
            except AuthenticationError:
                refused.append(True)
                break
        else:
            return
        good = Client(("127.0.0.1", spec.port), authkey=b"right-key")
        good.send_bytes(pickle.dumps(("hello", {"rank": 0, "host": "h", "pid": 1, "job": "7"})))
        time.sleep(4)
        good.close()

    t = threading.Thread(target=clients, daemon=True)
    t.start()
    with pytest.raises(AttachError, match=r"rank\(s\) \[1\] of 2 did not attach within 3s") as err:
        accept_ranks(spec, 2, timeout_s=3.0)
    assert "pid 1 on h" in str(err.value) and refused == [True]
