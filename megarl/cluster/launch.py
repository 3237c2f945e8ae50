"""`megarl launch slurm|local CONFIG [overrides] [--dry-run]`: start a job's pools and tear them all down together.

``slurm`` runs once in the batch step of ``launch/slurm/*.sbatch``: it computes the role map from
the allocation (``megarl.cluster.slurm``), prints it and the srun lines, and (without
``--dry-run``) runs one srun per pool -- the trainer ranks on the trainer nodes and the controller
on the generator node -- with a fresh job authkey in their environment. ``local`` runs the same
map as local processes under a simulated Slurm environment (every node is 127.0.0.1): one OS
process per task, the same ``megarl rank`` command each srun task runs.

Teardown (:func:`supervise`): when the controller exits 0, the trainer tasks (told to exit by it)
get ``cluster.teardown_timeout_s`` to follow; when any task or pool exits otherwise, the controller
gets that long to report the failure (it names the rank), then every task is sent SIGTERM, and
SIGKILL after as long again. srun's ``--kill-on-bad-exit=1`` ends a whole pool when one of its
tasks fails; the batch step ending ends anything left. Requeue-safe: tasks get
``trainer.resume_from=auto`` (unless given), and the restart count is logged.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megarl.config import ConfigError

log = logging.getLogger("megarl.cluster")

_POLL_S = 0.2
_LOG_EVERY_S = 30.0
# Once the controller has exited, the trainer ranks and generator replicas, which defer SIGTERM to it
# (megarl.utils.procs.defer_sigterm_to_controller), have no one left to checkpoint through: they get
# this long after SIGTERM (seconds; at most cluster.teardown_timeout_s) before SIGKILL. A task still
# connecting to a controller that never listened would otherwise hold the job for the whole teardown.
ORPHAN_GRACE_S = 3.0


@dataclass
class Task:
    label: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        out = open(self.log_path, "ab") if self.log_path else None
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True,
                                     stdout=out, stderr=subprocess.STDOUT if out else None)
        if out:
            out.close()
        log.info("started %s: pid %d%s", self.label, self.proc.pid, f", output in {self.log_path}" if out else "")


def megarl_command() -> list[str]:
    """How a task runs megarl: this interpreter (the job's venv, on the shared filesystem)."""
    return [sys.executable, "-m", "megarl"]


def task_overrides(overrides: Sequence[str], *, resume: bool) -> list[str]:
    """The overrides every task gets: attach mode, and resume-on-requeue for Slurm jobs."""
    out = [o for o in overrides if not o.startswith("cluster.launcher=")] + ["cluster.launcher=slurm"]
    if resume and not any(o.startswith("trainer.resume_from=") for o in overrides):
        out.append("trainer.resume_from=auto")
    return out


def _role_map(config: str, overrides: list[str], env: Mapping[str, str], *, dry_run: bool = False):
    from megarl.cluster.slurm import AllocationError, SlurmEnv, build_role_map
    from megarl.config import load_config

    # every config problem before an allocation second is spent; a dry run plans without the weights or data here
    cfg = load_config(config, overrides, dry_run=dry_run)
    try:
        return cfg, build_role_map(SlurmEnv.from_env(env), cfg)
    except AllocationError as e:
        raise ConfigError(e.problems, config) from None


def launch_slurm(config: str, overrides: Sequence[str], *, dry_run: bool = False,
                 env: Mapping[str, str] | None = None) -> int:
    """Inside an allocation: print the role map and srun lines; unless ``dry_run``, run them and
    supervise them (:func:`supervise`). Returns the job's exit code."""
    from megarl.cluster.slurm import format_srun
    from megarl.controller.startup import controller_log_path

    env = dict(os.environ if env is None else env)
    over = task_overrides(overrides, resume=True)
    cfg, rmap = _role_map(config, over, env, dry_run=dry_run)
    lines = rmap.srun_lines(megarl_command(), config, over)
    print(rmap.format())
    print("srun lines:\n" + format_srun(lines), flush=True)
    if dry_run:
        return 0
    _setup_logging()
    log.info("job %d: SLURM_RESTART_COUNT=%d%s", rmap.job_id, rmap.restart_count,
             " (requeued: the trainer resumes from its latest checkpoint)" if rmap.restart_count else "")
    job_env = {**env, **rmap.job_env(), "MEGARL_AUTHKEY": secrets.token_hex(16)}
    tasks = [Task(f"{key} srun", cmd, job_env) for key, cmd in lines.items()]  # the controller's first
    return supervise(tasks, cfg.cluster.teardown_timeout_s, preempt_grace_s=cfg.cluster.preempt_grace_s,
                     on_preempted=lambda: requeue(rmap.job_id, env), controller_log=controller_log_path(cfg))


def requeue(job_id: int, env: Mapping[str, str]) -> bool:
    """Ask Slurm to requeue this job (after a preemption checkpoint); False when it will not (the
    job was cancelled, or Slurm is already requeueing it: either way nothing more to do)."""
    try:
        out = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True, timeout=60,
                             env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("scontrol requeue %d failed: %s; resubmit the job to resume from its checkpoint", job_id, e)
        return False
    if out.returncode:
        log.warning("scontrol requeue %d: %s (a cancelled job stays cancelled; a preempted one is requeued by "
                    "Slurm itself)", job_id, (out.stderr or out.stdout).strip())
        return False
    log.warning("job %d requeued: it restarts from its checkpoint (SLURM_RESTART_COUNT + 1)", job_id)
    return True


def local_env(job_id: int, n_nodes: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A simulated allocation of ``n_nodes`` nodes ``sim0..`` that all resolve to 127.0.0.1."""
    from megarl.cluster.slurm import compress_nodelist

    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
    env.update({"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": compress_nodelist([f"sim{i}" for i in range(n_nodes)]),
                "SLURM_NNODES": str(n_nodes), "SLURM_RESTART_COUNT": "0", "MEGARL_SIM_ADDR": "127.0.0.1"})
    return env


def free_port_base(count: int = 3, tries: int = 50) -> int:
    """A base port with ``count`` consecutive free ports (the local launcher's cluster.port_base)."""
    import random

    for _ in range(tries):
        base = random.randrange(20000, 30000, 4)
        try:
            socks = [socket.create_server(("", base + i)) for i in range(count)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports found in 20000-30000 after {tries} tries")


def launch_local(config: str, overrides: Sequence[str], *, trainer_nodes: int = 1, dry_run: bool = False,
                 log_dir: str | os.PathLike | None = None) -> int:
    """The Slurm job's tasks as local processes: the controller + one process per trainer rank,
    spread over ``trainer_nodes`` simulated nodes (a teacher's or critic's ranks over one node each,
    unless cluster.teacher_nodes / critic_nodes say), same role map, same ``megarl rank`` command."""
    from megarl.cluster.slurm import PORTS_PER_JOB, format_srun, rank_pools_needed
    from megarl.controller.startup import controller_log_path
    from megarl.config import ConfigError, load_config

    if trainer_nodes < 1:
        raise ConfigError([f"--trainer-nodes {trainer_nodes}: must be >= 1 (simulated nodes of the trainer pool; "
                           f"default 1)"])
    cfg0 = load_config(config, list(overrides))
    t, g = cfg0.trainer, cfg0.generator
    n_train = t.tp * t.pp * t.dp
    gen_nodes = cfg0.cluster.generator_nodes or 1
    # the teacher's and the critic's rank pools: (role, ranks, simulated nodes: one unless sized)
    pools = [(role, n, nodes or 1) for role, n, nodes, _ in rank_pools_needed(cfg0)]
    given = {o.split("=", 1)[0] for o in overrides}
    extra = [f"cluster.trainer_nodes={trainer_nodes}", f"cluster.generator_nodes={gen_nodes}",
             *(f"cluster.{role}_nodes={nodes}" for role, _, nodes in pools)]
    if "cluster.ranks_per_node" not in given:
        per_node = max(math.ceil(n_train / trainer_nodes), g.tp * math.ceil(g.replicas / gen_nodes),
                       *(math.ceil(n / nodes) for _, n, nodes in pools))
        extra.append(f"cluster.ranks_per_node={per_node}")
    if "cluster.port_base" not in given:
        extra.append(f"cluster.port_base={free_port_base(PORTS_PER_JOB)}")
    over = task_overrides([*overrides, *extra], resume=False)
    env = local_env(os.getpid(), trainer_nodes + sum(nodes for *_, nodes in pools) + gen_nodes)
    cfg, rmap = _role_map(config, over, env)
    lines = rmap.srun_lines(megarl_command(), config, over)
    print(rmap.format())
    print("srun lines (a Slurm job would run; here each task is a local process):\n" + format_srun(lines), flush=True)
    if dry_run:
        return 0
    _setup_logging()
    env = {**env, **rmap.job_env(), "MEGARL_AUTHKEY": secrets.token_hex(16)}
    logs = Path(log_dir) if log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)

    def task(label: str, role: str, node: str, procid: int, local: int, nodeid: int) -> Task:
        task_env = {**env, "SLURMD_NODENAME": node, "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(local),
                    "SLURM_NODEID": str(nodeid)}
        return Task(label, rmap.task_command(megarl_command(), role, config, over), task_env,
                    logs / f"{label.replace(' ', '_')}.log" if logs else None)

    nodes = [*rmap.trainer_pool.nodes, *(n for p in rmap.rank_pools for n in p.pool.nodes), *rmap.generator_pool.nodes]
    tasks = [task("controller", "controller", rmap.controller_node, 0, 0, nodes.index(rmap.controller_node))]
    tasks += [task(f"{r.role} rank {r.rank}", r.role, r.node, r.rank, r.local_rank, nodes.index(r.node))
              for r in (*(r for r in rmap.ranks if r.role == "trainer"), *(r for p in rmap.rank_pools for r in p.ranks))]
    for replica in range(g.replicas):
        node, local = rmap.replica_node(replica)
        tasks.append(task(f"generator replica {replica}", "generator", node, replica, local, nodes.index(node)))
    log.info("local launch: %s", "; ".join(f"{x.label}: {shlex.join(x.argv[-4:])}" for x in tasks[:2]))
    return supervise(tasks, cfg.cluster.teardown_timeout_s, controller_log=controller_log_path(cfg))


def supervise(tasks: list[Task], teardown_s: float, *, preempt_grace_s: float = 0.0,
              on_preempted: Callable[[], object] | None = None, controller_log: Path | None = None) -> int:
    """Start ``tasks`` (the first is the controller) and wait for the job to end; any task's exit
    ends the job (see the module docstring). Returns the controller's code, else the failed task's.

    ``preempt_grace_s`` > 0 (a Slurm job): SIGTERM is a preemption. The controller (SIGTERM passed on
    to it) checkpoints and exits with PREEMPTED_EXIT within that many seconds; the other tasks are
    then stopped and ``on_preempted`` runs (the requeue). A controller that takes longer is stopped.

    ``controller_log``: the controller's full log; when the job fails, the line its command ended
    with (cause, component, what to do, logs: megarl/utils/errors.py) is printed again last, after
    the launcher's own lines, so the console (or the sbatch output) ends with it."""
    from megarl.utils.errors import last_line
    from megarl.utils.procs import PREEMPTED_EXIT, JobInterrupted, Preemption, signals_raise

    started = time.time()

    def failed_with(code: int) -> int:
        line = last_line(controller_log, since=started) if controller_log else None
        if line:
            print(line, file=sys.stderr, flush=True)
        return code

    ctrl, others = tasks[0], tasks[1:]
    preempt = Preemption() if preempt_grace_s > 0 else None
    with signals_raise(preemption=preempt):
        try:
            for x in tasks:
                x.start()
            log.info("waiting for the job to end: %s (bounded by the controller's own timeouts and the job's "
                     "time limit; any task's failure ends it)", ", ".join(x.label for x in tasks))
            while True:
                if preempt is not None and preempt.requested and ctrl.proc.poll() is None:
                    _preempt_controller(ctrl, preempt_grace_s)
                    if ctrl.proc.poll() is None:
                        _stop(tasks, teardown_s)
                        return 128 + signal.SIGTERM
                if ctrl.proc.poll() is not None:
                    code = ctrl.proc.returncode
                    if code in (0, PREEMPTED_EXIT):
                        _wait(others, teardown_s, "the trainer and generator tasks to exit after the controller "
                              + ("finished" if code == 0 else "checkpointed"))
                        _stop(others, teardown_s, controller_gone=True)
                        bad = [x for x in others if x.proc.returncode not in (0, None)]
                        for x in bad:
                            log.warning("%s %s after the controller finished", x.label, _how(x.proc.returncode))
                        if code == PREEMPTED_EXIT:
                            log.warning("the controller checkpointed after a preemption signal (exit %d)", code)
                            if on_preempted is not None:
                                on_preempted()
                        return code
                    log.error("controller %s; stopping every pool", _how(code))
                    _stop(others, teardown_s, controller_gone=True)
                    return failed_with(code)
                # Exit 0 = told to exit by the controller (it is shutting down); anything else is a failure.
                failed = [x for x in others if x.proc.poll() not in (None, 0)]
                if failed:
                    # One death takes its peers down with it (a rank blocked in a collective with a
                    # killed rank exits 1): look again after a poll and name every failed task, the
                    # ones killed by a signal (the likely cause) first.
                    time.sleep(_POLL_S)
                    failed = sorted((x for x in others if x.proc.poll() not in (None, 0)),
                                    key=lambda x: (x.proc.returncode >= 0, others.index(x)))
                    f = failed[0]
                    for x in failed[1:]:
                        log.error("%s %s", x.label, _how(x.proc.returncode))
                    log.error("%s %s while the controller runs; waiting up to %.0fs (cluster.teardown_timeout_s) "
                              "for the controller to report it, then stopping every pool", f.label,
                              _how(f.proc.returncode), teardown_s)
                    _wait([ctrl], teardown_s, "the controller to stop")
                    _stop(tasks, teardown_s, controller_gone=ctrl.proc.poll() is not None)
                    code = ctrl.proc.returncode
                    return failed_with(code if code not in (0, None) else (f.proc.returncode or 1))
                time.sleep(_POLL_S)
        except JobInterrupted:
            _stop(tasks, teardown_s)
            raise
        except BaseException:
            _stop(tasks, teardown_s)
            raise


def _preempt_controller(ctrl: Task, grace_s: float) -> None:
    """Pass the preemption on to the controller (a batch-only signal, ``--signal=B:USR1@s``, reaches
    only this process) as SIGUSR1, which srun forwards to its task unchanged (a SIGTERM would make
    srun SIGKILL it), and give it ``grace_s`` to checkpoint."""
    t0 = time.monotonic()
    try:
        os.kill(ctrl.proc.pid, signal.SIGUSR1)  # the srun client itself, not its process group
    except ProcessLookupError:
        pass
    log.warning("preemption: waiting up to %.0fs (cluster.preempt_grace_s) for the controller to checkpoint",
                grace_s)
    _wait([ctrl], grace_s, "the controller to checkpoint after the preemption signal")
    if ctrl.proc.poll() is None:
        log.error("the controller did not checkpoint within %.0fs (cluster.preempt_grace_s); stopping every pool: "
                  "the job resumes from its last periodic checkpoint", grace_s)
    else:
        log.info("the controller exited %.1fs after the preemption signal", time.monotonic() - t0)


def _wait(tasks: list[Task], timeout_s: float, what: str) -> None:
    live = [x for x in tasks if x.proc is not None and x.proc.poll() is None]
    if not live:
        return
    log.info("waiting up to %.0fs for %s (%s)", timeout_s, what, ", ".join(x.label for x in live))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(x.proc.poll() is None for x in live):
        time.sleep(_POLL_S)


def _signal(task: Task, sig: int) -> None:
    try:
        os.killpg(task.proc.pid, sig)  # its session: the task and whatever it started on this host
    except (ProcessLookupError, PermissionError):
        pass


def _stop(tasks: list[Task], timeout_s: float, *, controller_gone: bool = False) -> None:
    """SIGTERM every live task's process group, SIGKILL what is left after ``timeout_s``, reap.
    ``controller_gone``: the controller has exited, so nothing left waits on a checkpoint: the
    grace is ORPHAN_GRACE_S (at most ``timeout_s``)."""
    grace_s = min(timeout_s, ORPHAN_GRACE_S) if controller_gone else timeout_s
    live = [x for x in tasks if x.proc is not None and x.proc.poll() is None]
    for x in live:
        log.warning("stopping %s (pid %d): SIGTERM", x.label, x.proc.pid)
        _signal(x, signal.SIGTERM)
    _wait(live, grace_s, "the stopped tasks to exit" + (" (the controller is gone: no checkpoint to wait for)"
                                                        if controller_gone else ""))
    for x in tasks:
        if x.proc is None:
            continue
        if x.proc.poll() is None:
            log.warning("%s (pid %d) still running %.0fs after SIGTERM; SIGKILL", x.label, x.proc.pid, grace_s)
        _signal(x, signal.SIGKILL)  # also whatever it left behind in its session
        try:
            x.proc.wait(10)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not die after SIGKILL", x.label, x.proc.pid)


def _how(code: int | None) -> str:
    from megarl.executors.base import exit_cause

    return exit_cause(code)


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s launch %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


__all__ = ["Task", "launch_local", "launch_slurm", "local_env", "megarl_command", "supervise", "task_overrides"]
