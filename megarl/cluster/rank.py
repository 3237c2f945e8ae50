"""`megarl rank --role controller|trainer|generator|teacher|critic CONFIG [overrides]`: what every task of a launched job runs.

Each task recomputes the job's role map from the Slurm environment (``megarl.cluster.slurm``), so
the batch step and every task agree without passing the map around, checks that srun put it
where the map says, exports the job's variables (MEGARL_WORLD_SIZE, ports, temp dir), and then:

* ``controller`` (one task, first generator node): ``run_job`` with ``cluster.launcher=slurm``:
  the loop, with the trainer and generator executors in attach mode;
* ``trainer`` (one task per trainer rank, ``SLURM_PROCID`` = global trainer rank): a trainer rank
  that connects to the controller (``megarl.trainer.worker.attached_rank_main``);
* ``generator`` (one task per vLLM replica, ``SLURM_PROCID`` = replica index): a replica that
  connects to the controller (``megarl.generator.engine.attached_replica_main``) and runs its
  engine (its ``generator.tp`` workers are its own processes on this node);
* ``teacher`` / ``critic`` (one task per rank of that pool, ``SLURM_PROCID`` = its rank there): a
  Megatron rank, as a trainer rank, that joins its own pool's process group and attaches to the
  controller's teacher or critic executor at that role's channel port.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from megarl.config import ConfigError

log = logging.getLogger("megarl.cluster")

ROLES = ("controller", "trainer", "generator", "teacher", "critic")


def run_task(role: str, config: str, overrides: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run this task's part of the job; returns its exit code (a trainer rank never returns)."""
    from megarl.cluster.slurm import AllocationError, SlurmEnv, build_role_map, pick_device
    from megarl.config import load_config

    env = os.environ if env is None else env
    if role not in ROLES:
        raise ConfigError([f"--role {role!r}: one of {list(ROLES)}"])
    # Only the controller reads the data: the other tasks check its schema, not every row again.
    cfg = load_config(config, overrides, scan_data=role == "controller")
    if cfg.cluster.launcher != "slurm":
        raise ConfigError([f"cluster.launcher={cfg.cluster.launcher!r}: a launched task needs cluster.launcher=slurm "
                           "(`megarl launch` adds it)"], config)
    try:
        rmap = build_role_map(SlurmEnv.from_env(env), cfg)
    except AllocationError as e:
        raise ConfigError(e.problems, config) from None
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    procid, local = int(env.get("SLURM_PROCID", "0")), int(env.get("SLURM_LOCALID", "0"))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {role}{'' if role == 'controller' else procid} %(levelname)s "
                               "%(name)s: %(message)s")
    if role == "controller":
        expect_node, expect_local = rmap.controller_node, 0
    elif role == "generator":
        if procid >= cfg.generator.replicas:
            raise ConfigError([f"SLURM_PROCID={procid}: the generator pool has {cfg.generator.replicas} replica(s) "
                               "(generator.replicas); the srun line's --ntasks must match"], config)
        expect_node, expect_local = rmap.replica_node(procid)
    elif role in ("teacher", "critic"):
        pool = rmap.rank_pool(role)
        if pool is None:
            raise ConfigError([f"--role {role}: this job has no {role} (algorithm.teacher with distill_coef > 0, "
                               "algorithm.advantage gae|vtrace); run the srun lines of `megarl launch slurm`"], config)
        if procid >= pool.world:
            raise ConfigError([f"SLURM_PROCID={procid}: the {role} pool has {pool.world} rank(s); the srun line's "
                               "--ntasks must match"], config)
        expect_node, expect_local = pool.ranks[procid].node, pool.ranks[procid].local_rank
    else:
        if procid >= rmap.trainer_world:
            raise ConfigError([f"SLURM_PROCID={procid}: the trainer pool has {rmap.trainer_world} rank(s) "
                               "(trainer tp*pp*dp); the srun line's --ntasks must match"], config)
        want = rmap.trainer_rank(procid)
        expect_node, expect_local = want.node, want.local_rank
    if (node, local) != (expect_node, expect_local):
        raise ConfigError([f"srun placed {role} task {procid} on {node} as local task {local}, but the role map "
                           f"expects {expect_node} local {expect_local}; run the srun lines of `megarl launch slurm` "
                           "unchanged (--distribution=block, --ntasks-per-node)"], config)
    os.environ.update(rmap.job_env())
    tmp = Path(rmap.tmp_dir) / f"{role}{procid}"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)

    def cleanup() -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    if role == "controller":
        log.info("controller of job %d on %s (SLURM_RESTART_COUNT=%d); MEGARL_WORLD_SIZE=%d, listening on port %d",
                 rmap.job_id, node, rmap.restart_count, rmap.world_size, rmap.controller_port)
        from megarl.controller import run_job

        try:
            return run_job(cfg)
        finally:
            cleanup()
    key = env.get("MEGARL_AUTHKEY", "")
    if not key:
        raise ConfigError(["MEGARL_AUTHKEY is not set: start trainer and generator tasks with `megarl launch slurm` "
                           "(it exports the job's key to every srun task)"], config)
    if role == "generator":
        return _generator_task(cfg, rmap, procid, local, node, key, env, cleanup)
    pool = rmap.rank_pool(role)
    # (world, gpus a node, controller's port for this role, rendezvous address and port, connect timeout): a
    # teacher's or critic's executor starts after the trainer's and the generator's, so its ranks wait that long
    world, gpus, channel, master_addr, master_port, connect_s = (
        (rmap.trainer_world, rmap.trainer_pool.gpus_per_node, rmap.controller_port, rmap.master_addr,
         rmap.master_port, cfg.trainer.start_timeout_s) if pool is None else
        (pool.world, pool.pool.gpus_per_node, pool.channel_port, pool.master_addr, pool.master_port,
         cfg.trainer.start_timeout_s + cfg.generator.start_timeout_s))
    device = None if cfg.cluster.device == "cpu" else pick_device(env.get("CUDA_VISIBLE_DEVICES"), local, gpus)
    log.info("%s rank %d of %d on %s (local %d, device %s); controller %s:%d, rendezvous %s:%d", role,
             procid, world, node, local, device, rmap.controller_addr, channel, master_addr, master_port)
    from megarl.trainer.worker import attached_rank_main

    try:
        attached_rank_main(procid, world, controller=(rmap.controller_addr, channel),
                           authkey=key.encode(), job_id=str(rmap.job_id), master_addr=master_addr,
                           master_port=master_port, connect_timeout_s=connect_s,
                           cuda_devices=device, cleanup=cleanup)
    finally:  # reached only when it failed before serving (attached_rank_main exits the process)
        cleanup()
    return 1


def _generator_task(cfg, rmap, replica: int, local: int, node: str, key: str, env: Mapping[str, str],
                    cleanup) -> int:
    """A vLLM replica on this generator node: its devices and CPU binding, then attach."""
    import dataclasses

    from megarl.cluster.slurm import pick_device
    from megarl.generator.engine import attached_replica_main
    from megarl.generator.threads import threads_binds

    g = cfg.generator
    on_cpu = cfg.cluster.device == "cpu" or (cfg.cluster.device == "auto" and not rmap.generator_pool.gpus_per_node)
    device = None if on_cpu else pick_device(env.get("CUDA_VISIBLE_DEVICES"), local,
                                             rmap.generator_pool.gpus_per_node, count=g.tp)
    bind = None
    if on_cpu:  # an explicit binding names every replica; auto splits this node's cores over its replicas
        bind = (threads_binds(g)[replica] if g.threads_bind != "auto" else
                threads_binds(dataclasses.replace(g, replicas=rmap.generator_pool.tasks_per_node))[local])
    log.info("generator replica %d of %d on %s (local %d, devices %s, cpu bind %s); controller %s:%d",
             replica, g.replicas, node, local, device, bind, rmap.controller_addr, rmap.generator_port)
    try:
        attached_replica_main(replica, controller=(rmap.controller_addr, rmap.generator_port), authkey=key.encode(),
                              job_id=str(rmap.job_id), connect_timeout_s=g.start_timeout_s, threads_bind=bind,
                              cuda_devices=device, cleanup=cleanup)
    finally:  # reached only when it failed before running the engine (replica_main exits the process)
        cleanup()
    return 1


__all__ = ["ROLES", "run_task"]
