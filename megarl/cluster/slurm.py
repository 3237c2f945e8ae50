"""Slurm environment -> the job's rank -> role map and its srun lines (pure: no torch, no side effects).

One allocation, two node pools: the first ``cluster.trainer_nodes`` nodes of ``SLURM_JOB_NODELIST``
are the **trainer pool** (one srun task per trainer rank, ``--ntasks-per-node`` of them per node,
block distribution, so global trainer rank ``r`` = ``SLURM_PROCID``), the rest the **generator
pool** (one srun task per vLLM replica, ``generator.replicas`` spread evenly over its nodes, so
replica ``i`` = ``SLURM_PROCID`` of that step; each replica's ``generator.tp`` workers are its
own processes on its node). A job with a distillation teacher or a critic has a **rank pool** for
each between the two (``cluster.teacher_nodes``, ``cluster.critic_nodes``): Megatron ranks like the
trainer's, one srun task each, in a process group of their own (their own rendezvous and channel
ports), attaching to the controller's teacher or critic executor. The controller runs as one more task on the first generator node;
trainer ranks and replicas attach to it over TCP. A heterogeneous job (``#SBATCH hetjob``) gives
the pools as het group 0 (trainer) and 1 (generator) instead.

Each srun line asks for what its tasks need: ``--cpus-per-task`` from the node's CPUs
(``SLURM_JOB_CPUS_PER_NODE``): a trainer node's CPUs split over its ranks; on a generator node
``cluster.controller_cpus`` for the controller (its loop, reward pool and DDMA store; it shares
the node with ``--overlap``) and the rest split over the node's replicas.

Job ranks (``MEGARL_WORLD_SIZE`` of them): trainer ranks ``0 .. T-1`` (megatron order, ``tp``
fastest, ``rank_coords`` of the trainer executor), then generator workers ``T .. T+G-1``
(replica-major, ``generator.tp`` per replica). The controller is a process, not a rank.

Everything job-scoped comes from ``SLURM_JOB_ID``: the ports (trainer rendezvous and the
controller's channel; ``job_ports``) and the temp dir (``$TMPDIR/megarl-<job>.<restart>``), so two
jobs that share a node never collide. ``MEGARL_SIM_ADDR`` (set by ``megarl launch local`` only)
makes every node name resolve to one address: the same map then runs as local processes.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megarl.algorithms.config import needs_critic, needs_teacher
from megarl.config.job import JOB_DEVICE_ENV, job_device, resolved_sync
from megarl.config.loader import ConfigError
from megarl.config.schema import PORTS_PER_JOB
from megarl.ddma.transport.choice import job_nccl_env
from megarl.executors.attach import channel_port_var, rendezvous_vars

PORT_FLOOR = 15000   # job ports live in [15000, 31000): below Linux's ephemeral range (32768+)
PORT_SLOTS = 2000    # jobs whose ids differ by a multiple of this share ports (only a problem on a shared node)
# PORTS_PER_JOB (config/schema.py, beside cluster.port_base): base: trainer rendezvous (MASTER_PORT),
# base+1: trainer channel, base+2: generator channel, then the rank pools':
ROLE_PORTS = {"teacher": 3, "critic": 5}  # base+k: that rank pool's rendezvous, base+k+1: its channel


class AllocationError(ValueError):
    """The allocation and the config do not fit; each line names what to change."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("the Slurm allocation does not fit the job:\n  " + "\n  ".join(self.problems))


# ---------------------------------------------------------------------------------- nodelists
def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"nodelist {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"nodelist {text!r}: unbalanced '['")
    return [p.strip() for p in parts + [cur] if p.strip()]


def _expand_ranges(body: str, text: str) -> list[str]:
    out = []
    for part in body.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"nodelist {text!r}: {part!r} is not a number or range like 01-03")
        width = len(lo)
        out += [str(i).zfill(width) for i in range(int(lo), int(hi or lo) + 1)]
    return out


def parse_nodelist(text: str) -> list[str]:
    """``"node[01-03,07],gpu5"`` -> ``["node01", "node02", "node03", "node07", "gpu5"]`` (Slurm's
    hostlist syntax: zero padding kept, several bracket groups per name expand as a product)."""
    nodes: list[str] = []
    for item in _split_top(text):
        names = [""]
        for m in re.finditer(r"([^\[\]]+)|\[([^\[\]]*)\]", item):
            pieces = [m.group(1)] if m.group(1) is not None else _expand_ranges(m.group(2), text)
            names = [n + p for n in names for p in pieces]
        nodes += names
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"nodelist {text!r} names a node twice")
    return nodes


def compress_nodelist(nodes: Sequence[str]) -> str:
    """The inverse of :func:`parse_nodelist` for printing: consecutive numbered names of the same
    prefix and width fold into ``prefix[a-b,c]``; order is kept."""
    groups: list[tuple[str, int, list[int]]] = []  # (prefix, width, numbers); width 0 = no number
    for n in nodes:
        m = re.fullmatch(r"(.*?)(\d+)", n)
        prefix, width, num = (m.group(1), len(m.group(2)), int(m.group(2))) if m else (n, 0, -1)
        if groups and width and groups[-1][:2] == (prefix, width) and num > groups[-1][2][-1]:
            groups[-1][2].append(num)
        else:
            groups.append((prefix, width, [num]))
    out = []
    for prefix, width, nums in groups:
        if not width:
            out.append(prefix)
            continue
        if len(nums) == 1:
            out.append(f"{prefix}{nums[0]:0{width}d}")
            continue
        runs, start = [], nums[0]
        for a, b in zip(nums, nums[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start:0{width}d}" + (f"-{a:0{width}d}" if a != start else ""))
                start = b
        out.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(out)


def _gpu_count(value: str | None) -> int:
    """``"8"``, ``"h100:8"``, ``"gpu:h100:8"`` -> 8; unset or unreadable -> 0."""
    if not value:
        return 0
    last = value.split(",")[0].split(":")[-1].split("(")[0]
    return int(last) if last.isdigit() else 0


def parse_cpus_per_node(value: str | None) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE``: ``"72(x2),36"`` -> ``[72, 72, 36]``; unset -> ``[]``."""
    out: list[int] = []
    for part in filter(None, (value or "").split(",")):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


# ------------------------------------------------------------------------------ environment
@dataclass(frozen=True)
class SlurmEnv:
    """What the job-level Slurm variables say (the same in the batch step and in every task)."""
    job_id: int
    nodes: tuple[str, ...]
    gpus_per_node: int                   # 0: no GPUs requested (or not said)
    restart_count: int = 0
    het_groups: tuple[tuple[str, ...], ...] = ()   # (trainer nodes, generator nodes) of a het job
    het_gpus: tuple[int, ...] = ()
    tmp_root: str = "/tmp"
    sim_addr: str = ""                   # MEGARL_SIM_ADDR: every node is this address (local simulation)
    cpus: tuple[int, ...] = ()           # CPUs of each node of ``nodes`` (SLURM_JOB_CPUS_PER_NODE); () = unknown

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SlurmEnv":
        job = env.get("SLURM_JOB_ID", "")
        if not job.isdigit():
            raise AllocationError([f"SLURM_JOB_ID={job!r}: not inside a Slurm allocation; submit with "
                                   "`sbatch launch/slurm/train.sbatch CONFIG`, or run `megarl launch local` here"])
        het: list[tuple[str, ...]] = []
        het_gpus: list[int] = []
        het_cpus: list[int] = []
        while f"SLURM_JOB_NODELIST_HET_GROUP_{len(het)}" in env:
            k = len(het)
            het.append(tuple(parse_nodelist(env[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"])))
            het_gpus.append(_gpu_count(env.get(f"SLURM_GPUS_PER_NODE_HET_GROUP_{k}"))
                            or _gpu_count(env.get(f"SLURM_GPUS_ON_NODE_HET_GROUP_{k}")))
            cpus_k = parse_cpus_per_node(env.get(f"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{k}"))
            het_cpus += cpus_k if len(cpus_k) == len(het[-1]) else [0] * len(het[-1])
        # A het job's batch step: SLURM_JOB_NODELIST / SLURM_NNODES describe group 0 only (Slurm 22.05).
        listed = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        nodes = [n for g in het for n in g] if het else parse_nodelist(listed)
        if not nodes:
            raise AllocationError(["SLURM_JOB_NODELIST is empty: is this a Slurm job step?"])
        count = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES", "")
        if not het and count.isdigit() and int(count) != len(nodes):
            raise AllocationError([f"SLURM_NNODES={count} but SLURM_JOB_NODELIST={listed!r} names {len(nodes)} "
                                   "node(s): the environment is inconsistent"])
        gpus = _gpu_count(env.get("SLURM_GPUS_ON_NODE")) or _gpu_count(env.get("SLURM_GPUS_PER_NODE"))
        cpus = het_cpus if het else parse_cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE"))
        restart = env.get("SLURM_RESTART_COUNT", "0")
        return cls(int(job), tuple(nodes), gpus, int(restart) if restart.isdigit() else 0, tuple(het),
                   tuple(het_gpus), env.get("TMPDIR") or "/tmp", env.get("MEGARL_SIM_ADDR", ""),
                   tuple(cpus) if len(cpus) == len(nodes) and all(cpus) else ())

    def node_cpus(self, nodes: Sequence[str]) -> int:
        """The fewest CPUs any of ``nodes`` has in this job (0 = unknown)."""
        if not self.cpus:
            return 0
        return min(self.cpus[self.nodes.index(n)] for n in nodes)

    def addr(self, node: str) -> str:
        """The address other nodes reach ``node`` at (its name; the simulation's one address)."""
        return self.sim_addr or node


def job_ports(job_id: int, port_base: int = 0) -> tuple[int, int, int]:
    """(trainer rendezvous port, trainer channel port, generator channel port) of a job:
    ``cluster.port_base`` when set, else a slot of PORTS_PER_JOB ports chosen by the job id."""
    base = port_base or PORT_FLOOR + (job_id % PORT_SLOTS) * PORTS_PER_JOB
    return base, base + 1, base + 2


def role_ports(job_id: int, role: str, port_base: int = 0) -> tuple[int, int]:
    """(rendezvous port, channel port) of a rank pool ``role`` (teacher, critic): its slot of the job's ports."""
    base = job_ports(job_id, port_base)[0] + ROLE_PORTS[role]
    return base, base + 1


def rank_pools_needed(cfg) -> list[tuple[str, int, int, tuple[int, int, int]]]:
    """(role, ranks, cluster.<role>_nodes, (tp, pp, dp)) of each rank pool the job has besides the trainer's:
    the distillation teacher (the trainer's layout: megarl/trainer/forward_only.py) and the critic (its own)."""
    out = []
    t = cfg.trainer
    if needs_teacher(cfg.algorithm):
        out.append(("teacher", t.tp * t.pp * t.dp, cfg.cluster.teacher_nodes, (t.tp, t.pp, t.dp)))
    if needs_critic(cfg.algorithm):
        tp, pp, dp = cfg.critic.layout(t)
        out.append(("critic", tp * pp * dp, cfg.cluster.critic_nodes, (tp, pp, dp)))
    return out


# ----------------------------------------------------------------------------------- the map
@dataclass(frozen=True)
class RankRole:
    rank: int            # job rank (0..MEGARL_WORLD_SIZE-1)
    role: str            # "trainer" | "generator"
    node: str
    local_rank: int      # index among the ranks of this role on its node
    device: int | None   # GPU index on the node (None on a CPU pool)
    detail: str          # "tp 0 pp 0 dp 1" / "replica 0 worker 1"


@dataclass(frozen=True)
class Pool:
    name: str                    # "trainer" | "generator"
    nodes: tuple[str, ...]
    tasks_per_node: int          # srun tasks per node (trainer: its ranks; generator: its replicas)
    gpus_per_node: int
    het_group: int | None = None
    cpus_per_task: int = 0       # --cpus-per-task of the pool's tasks (0 = the node's CPUs are unknown)
    gpus_per_task: int = 1       # devices each task takes (trainer: 1; generator: generator.tp)


@dataclass(frozen=True)
class RankPool:
    """A pool of Megatron ranks beside the trainer's (the teacher's, the critic's): where its ranks run and
    where they meet (their own rendezvous, and the controller's channel for that role)."""
    pool: Pool
    ranks: tuple[RankRole, ...]      # RankRole.rank: the rank within this pool (its SLURM_PROCID)
    master_addr: str
    master_port: int
    channel_port: int

    @property
    def role(self) -> str:
        return self.pool.name

    @property
    def world(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class RoleMap:
    job_id: int
    restart_count: int
    trainer_pool: Pool
    generator_pool: Pool
    ranks: tuple[RankRole, ...]
    trainer_world: int
    master_addr: str
    master_port: int
    controller_node: str
    controller_addr: str
    controller_port: int
    tmp_dir: str
    notes: tuple[str, ...] = ()
    generator_port: int = 0
    controller_cpus: int = 0     # --cpus-per-task of the controller (0 = unknown node CPUs)
    transport: str = ""          # the DDMA transport the placement picked ("" = leave sync.transport alone)
    device: str = "cpu"          # where the executors' weights live: 'cpu' | 'cuda' (config/job.py job_device)
    rank_pools: tuple[RankPool, ...] = ()  # the teacher's, the critic's (not in MEGARL_WORLD_SIZE: not DDMA's)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank_pool(self, role: str) -> RankPool | None:
        return next((p for p in self.rank_pools if p.role == role), None)

    def trainer_rank(self, rank: int) -> RankRole:
        if not 0 <= rank < self.trainer_world:
            raise ValueError(f"trainer rank {rank} outside 0..{self.trainer_world - 1}")
        return self.ranks[rank]

    def job_env(self) -> dict[str, str]:
        """The variables every task of the job gets (besides MEGARL_AUTHKEY, chosen per launch)."""
        return {"MEGARL_WORLD_SIZE": str(self.world_size), "MEGARL_JOB_ID": str(self.job_id),
                "MEGARL_MASTER_ADDR": self.master_addr, "MEGARL_MASTER_PORT": str(self.master_port),
                "MEGARL_CONTROLLER_ADDR": self.controller_addr, "MEGARL_CONTROLLER_PORT": str(self.controller_port),
                "MEGARL_GENERATOR_PORT": str(self.generator_port), "MEGARL_TMPDIR": self.tmp_dir,
                JOB_DEVICE_ENV: self.device,  # the controller's resolved job takes it (megarl/config/job.py)
                **{k: v for p in self.rank_pools for k, v in zip(
                    (channel_port_var(p.role), *rendezvous_vars(p.role)),
                    (str(p.channel_port), p.master_addr, str(p.master_port)))},
                **job_nccl_env(os.environ)}  # one NCCL setting on every node (megarl/ddma/transport/choice.py)

    @property
    def generator_world(self) -> int:
        return self.world_size - self.trainer_world

    def replica_node(self, replica: int) -> tuple[str, int]:
        """(node, local task index) of generator replica ``replica``."""
        g = self.generator_pool
        return g.nodes[replica // g.tasks_per_node], replica % g.tasks_per_node

    def task_command(self, megarl: Sequence[str], role: str, config: str, overrides: Sequence[str]) -> list[str]:
        """What one task of ``role`` ("controller" | "trainer" | "generator" | "teacher" | "critic") runs."""
        return [*megarl, "rank", "--role", role, config, *overrides]

    def srun_lines(self, megarl: Sequence[str], config: str, overrides: Sequence[str]) -> dict[str, list[str]]:
        """One srun per part: ``controller`` (one task on the first generator node, no GPU, sharing
        the node with the replicas), ``trainer`` (every trainer rank) and ``generator`` (every
        vLLM replica, spread over the generator nodes), and one per rank pool (``teacher``, ``critic``: every
        rank of it, on its nodes)."""
        t, g = self.trainer_pool, self.generator_pool
        n_replicas = len(g.nodes) * g.tasks_per_node
        lines = {}
        for key, pool, nodes, ntasks, per_node, cpus, gpus in (
                ("controller", g, (self.controller_node,), 1, 1, self.controller_cpus, 0),
                ("trainer", t, t.nodes, self.trainer_world, t.tasks_per_node, t.cpus_per_task, t.gpus_per_node),
                *((p.role, p.pool, p.pool.nodes, p.world, p.pool.tasks_per_node, p.pool.cpus_per_task,
                   p.pool.gpus_per_node) for p in self.rank_pools),
                ("generator", g, g.nodes, n_replicas, g.tasks_per_node, g.cpus_per_task,
                 g.gpus_per_task * g.tasks_per_node if g.gpus_per_node else 0)):
            cmd = ["srun", f"--job-name=megarl-{key}", f"--nodes={len(nodes)}", f"--ntasks={ntasks}",
                   f"--ntasks-per-node={per_node}"]
            cmd += [f"--het-group={pool.het_group}"] if pool.het_group is not None else \
                   [f"--nodelist={compress_nodelist(nodes)}"]
            if cpus:
                cmd.append(f"--cpus-per-task={cpus}")
            if gpus:
                cmd.append(f"--gpus-per-node={gpus}")  # a task takes GPUs [SLURM_LOCALID * gpus_per_task, ...)
            if key == "controller":
                cmd.append("--overlap")  # it shares the first generator node's CPUs with the replicas
            cmd += ["--distribution=block", "--kill-on-bad-exit=1", "--export=ALL", "--unbuffered"]
            lines[key] = cmd + self.task_command(megarl, key, config, overrides)
        return lines

    def format(self) -> str:
        """The human-readable map (what `--dry-run` prints)."""
        t, g = self.trainer_pool, self.generator_pool
        gen = [r for r in self.ranks if r.role == "generator"]
        het = " (heterogeneous job: het groups 0 and 1)" if t.het_group is not None else ""
        pools = "".join(f" + {p.role} pool {p.world} rank(s)" for p in self.rank_pools)
        n_nodes = len(t.nodes) + len(g.nodes) + sum(len(p.pool.nodes) for p in self.rank_pools)
        gpus = sum(x.gpus_per_node * len(x.nodes) for x in (t, g, *(p.pool for p in self.rank_pools)))
        out = [f"job {self.job_id} (restart {self.restart_count}): {n_nodes} node(s){het}, {gpus or 'no'} GPU(s); "
               f"MEGARL_WORLD_SIZE={self.world_size} (trainer {self.trainer_world} + generator {len(gen)}){pools}",
               f"trainer pool:   {compress_nodelist(t.nodes)}  ({t.tasks_per_node} rank(s) per node, "
               f"{t.gpus_per_node or 'no'} GPU(s) per node)",
               *(f"{p.role + ' pool:':<15} {compress_nodelist(p.pool.nodes)}  ({p.pool.tasks_per_node} rank(s) per "
                 f"node, {p.pool.gpus_per_node or 'no'} GPU(s) per node; its own process group, rendezvous "
                 f"{p.master_addr}:{p.master_port}, channel {p.channel_port})" for p in self.rank_pools),
               f"generator pool: {compress_nodelist(g.nodes)}  ({g.tasks_per_node} replica(s) per node, "
               f"{len(gen)} vLLM worker(s); controller on {self.controller_node})",
               f"MASTER_ADDR={self.master_addr} MASTER_PORT={self.master_port}  controller "
               f"{self.controller_addr}:{self.controller_port} (trainer) / {self.generator_port} (generator)  "
               f"tmp {self.tmp_dir}",
               f"cpus per task: controller {self.controller_cpus or '-'}, trainer rank {t.cpus_per_task or '-'}, "
               f"replica {g.cpus_per_task or '-'}" + (f"; DDMA transport {self.transport} (placement)"
                                                      if self.transport else ""),
               f"{'rank':>5}  {'role':<10} {'node':<12} {'local':>5} {'device':>6}  detail"]
        out += [f"{r.rank:>5}  {r.role:<10} {r.node:<12} {r.local_rank:>5} "
                f"{'-' if r.device is None else r.device:>6}  {r.detail}"
                for r in (*self.ranks, *(r for p in self.rank_pools for r in p.ranks))]
        out.append(f"{'-':>5}  {'controller':<10} {self.controller_node:<12} {'-':>5} {'-':>6}  "
                   f"megarl train (cluster.launcher=slurm): runs the loop; ranks and replicas attach to it")
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def build_role_map(env: SlurmEnv, cfg) -> RoleMap:
    """The job's role map for config ``cfg`` (a MegaRLConfig) on allocation ``env``; raises
    :class:`AllocationError` listing every misfit, each naming the knob or #SBATCH option to change."""
    c, t, g = cfg.cluster, cfg.trainer, cfg.generator
    n_train, n_gen = t.tp * t.pp * t.dp, g.tp * g.replicas
    problems: list[str] = []
    extra = rank_pools_needed(cfg)  # the teacher's and the critic's rank pools, when the job has them
    aux_nodes: dict[str, tuple[str, ...]] = {}
    if env.het_groups and extra:
        raise AllocationError([f"a heterogeneous job has no node pool for the {' and the '.join(r for r, *_ in extra)}: "
                               "submit one homogeneous allocation (#SBATCH --nodes, no hetjob) and size the pools "
                               "with cluster.trainer_nodes, cluster.teacher_nodes / cluster.critic_nodes and "
                               "cluster.generator_nodes"])
    if env.het_groups:
        if len(env.het_groups) != 2:
            raise AllocationError([f"a heterogeneous job with {len(env.het_groups)} het group(s): megarl needs "
                                   "exactly 2 (group 0 = trainer nodes, group 1 = generator nodes)"])
        t_nodes, g_nodes = env.het_groups
        t_gpus, g_gpus = (x or env.gpus_per_node for x in env.het_gpus)
        for key, want, got in (("trainer_nodes", c.trainer_nodes, len(t_nodes)),
                               ("generator_nodes", c.generator_nodes, len(g_nodes))):
            if want and want != got:
                problems.append(f"cluster.{key}={want}: het group {key.startswith('generator'):d} has {got} node(s); "
                                f"set cluster.{key}={got} (or 0) or change that group's #SBATCH --nodes")
    else:
        t_gpus = g_gpus = env.gpus_per_node
        per = c.ranks_per_node or env.gpus_per_node
        if not per:
            raise AllocationError(["cannot tell how many ranks a node holds: the job has no GPUs "
                                   "(SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE unset); request them "
                                   "(#SBATCH --gpus-per-node=8) or set cluster.ranks_per_node"])
        want_t = c.trainer_nodes or math.ceil(n_train / per)
        want_x = {role: given or math.ceil(n / per) for role, n, given, _ in extra}
        before_g = want_t + sum(want_x.values())
        want_g = c.generator_nodes or max(1, len(env.nodes) - before_g)
        for key in ("generator_nodes", *(f"{role}_nodes" for role in want_x)):
            if getattr(c, key) < 0:
                problems.append(f"cluster.{key}={getattr(c, key)}: must be >= 0 (0 = derived)")
        if before_g + want_g != len(env.nodes):
            sizes = [("trainer", want_t, c.trainer_nodes), *((r, want_x[r], given) for r, _, given, _ in extra),
                     ("generator", want_g, c.generator_nodes)]
            problems.append(
                f"the allocation has {len(env.nodes)} node(s) ({compress_nodelist(env.nodes)}) but the job needs "
                + " + ".join(f"cluster.{r}_nodes={n}{' (derived)' if not given else ''}" for r, n, given in sizes)
                + f" = {before_g + want_g}; submit with --nodes={before_g + want_g} or change "
                + " / ".join(f"cluster.{r}_nodes" for r, _, _ in sizes))
        t_nodes, at = env.nodes[:want_t], want_t
        for role, n in want_x.items():  # the rank pools sit between the trainer's and the generator's nodes
            aux_nodes[role], at = env.nodes[at:at + n], at + n
        g_nodes = env.nodes[at:at + want_g]
    per_t = c.ranks_per_node or t_gpus
    per_g = c.ranks_per_node or g_gpus
    if not t_nodes:
        problems.append("the trainer pool is empty: give it nodes (cluster.trainer_nodes, or more --nodes)")
    elif n_train % len(t_nodes) or n_train < len(t_nodes):
        problems.append(f"trainer tp*pp*dp={n_train} rank(s) do not spread evenly over {len(t_nodes)} trainer "
                        f"node(s); change trainer.dp or cluster.trainer_nodes")
    elif per_t and n_train // len(t_nodes) > per_t:
        problems.append(f"trainer tp*pp*dp={n_train} rank(s) need {n_train // len(t_nodes)} per node on "
                        f"{len(t_nodes)} node(s), but a node holds {per_t}; raise cluster.trainer_nodes to "
                        f"{math.ceil(n_train / per_t)} or lower trainer.dp")
    for role, n, _, _ in extra:  # each rank pool spreads like the trainer's
        nodes = aux_nodes.get(role, ())
        what = f"the {role}'s {n} rank(s) ({'the trainer' if role == 'teacher' else role}'s tp*pp*dp)"
        if not nodes:
            problems.append(f"the {role} pool is empty: give it nodes (cluster.{role}_nodes, or more --nodes)")
        elif n % len(nodes) or n < len(nodes):
            problems.append(f"{what} do not spread evenly over {len(nodes)} {role} node(s); change "
                            f"cluster.{role}_nodes")
        elif per_t and n // len(nodes) > per_t:
            problems.append(f"{what} need {n // len(nodes)} per node on {len(nodes)} node(s), but a node holds {per_t}; "
                            f"raise cluster.{role}_nodes to {math.ceil(n / per_t)}")
    if not g_nodes:
        problems.append("the generator pool is empty: give it nodes (cluster.generator_nodes, or more --nodes)")
    elif g.replicas % len(g_nodes) or g.replicas < len(g_nodes):
        problems.append(f"generator.replicas={g.replicas} do not spread evenly over {len(g_nodes)} generator "
                        f"node(s); set generator.replicas to a multiple of {len(g_nodes)} or change "
                        "cluster.generator_nodes")
    elif per_g and g.replicas // len(g_nodes) * g.tp > per_g:
        problems.append(f"generator tp*replicas={n_gen} GPU(s) need {g.replicas // len(g_nodes) * g.tp} per node on "
                        f"{len(g_nodes)} node(s), but a node holds {per_g}; lower generator.replicas to "
                        f"{max(per_g // g.tp, 1) * len(g_nodes)} or add generator nodes")
    if c.trainer_devices or c.generator_devices:
        problems.append("cluster.trainer_devices / cluster.generator_devices are set: under a launcher each "
                        "trainer rank takes GPU [SLURM_LOCALID] of its node and each replica generator.tp GPUs "
                        "from [SLURM_LOCALID * generator.tp]; clear them")
    per_node = n_train // max(len(t_nodes), 1)
    rpn = g.replicas // max(len(g_nodes), 1)
    cpus_t, cpus_g = env.node_cpus(t_nodes) if t_nodes else 0, env.node_cpus(g_nodes) if g_nodes else 0
    ctrl_cpus = min(c.controller_cpus, cpus_g) if cpus_g else 0
    replica_cpus = (cpus_g - ctrl_cpus) // max(rpn, 1) if cpus_g else 0
    if cpus_g and rpn and replica_cpus < 1:
        problems.append(f"a generator node has {cpus_g} CPU(s): cluster.controller_cpus={c.controller_cpus} leaves "
                        f"none for its {rpn} replica(s); lower cluster.controller_cpus")
    if problems:
        raise AllocationError(problems)

    controller = g_nodes[0]
    # The job's one device rule on the allocation's GPUs; the controller task takes the device from the job
    # environment (JOB_DEVICE_ENV) and resolves the same transport (megarl/config/job.py).
    device = job_device(cfg.cluster.device, t_gpus + g_gpus)
    transport = ""
    if cfg.sync.method == "ddma":  # the pools are always other nodes
        try:
            transport = resolved_sync(cfg, device=device, same_host=False).transport
        except ConfigError as e:
            raise AllocationError([p + " (the trainer and generator pools are different nodes)"
                                   for p in e.problems]) from None
    ranks = []
    for r in range(n_train):  # megatron order, as TrainerExecutor's rank_coords
        local = r % per_node
        ranks.append(RankRole(r, "trainer", t_nodes[r // per_node], local, local if t_gpus else None,
                              f"tp {r % t.tp} pp {r // (t.tp * t.dp)} dp {(r // t.tp) % t.dp}"))
    for w in range(n_gen):
        replica, worker = divmod(w, g.tp)
        local = (replica % rpn) * g.tp + worker
        ranks.append(RankRole(n_train + w, "generator", g_nodes[replica // rpn], local, local if g_gpus else None,
                              f"replica {replica} worker {worker}"))
    notes = []
    if per_node % t.tp:
        notes.append(f"trainer.tp={t.tp} does not divide the {per_node} rank(s) per node: TP groups span nodes "
                     "(slow); prefer a tp that divides the ranks per node")
    if not cpus_g or not cpus_t:
        notes.append("SLURM_JOB_CPUS_PER_NODE is unset: the srun lines ask for no --cpus-per-task")
    notes += placement_lines(cfg, g_gpus, controller)
    master_port, ctrl_port, gen_port = job_ports(env.job_id, c.port_base)
    het = bool(env.het_groups)
    rank_pools = []
    for role, n, _, (tp, pp, dp) in extra:
        nodes, per = aux_nodes[role], n // len(aux_nodes[role])
        cpus = env.node_cpus(nodes)
        pool_ranks = tuple(RankRole(r, role, nodes[r // per], r % per, r % per if t_gpus else None,
                                    f"{role} rank {r}: tp {r % tp} pp {r // (tp * dp)} dp {(r // tp) % dp}")
                           for r in range(n))
        rendezvous, channel = role_ports(env.job_id, role, c.port_base)
        rank_pools.append(RankPool(Pool(role, tuple(nodes), per, t_gpus, None, cpus // per if cpus else 0, 1),
                                   pool_ranks, env.addr(nodes[0]), rendezvous, channel))
    return RoleMap(env.job_id, env.restart_count,
                   Pool("trainer", tuple(t_nodes), per_node, t_gpus, 0 if het else None,
                        cpus_t // per_node if cpus_t else 0, 1),
                   Pool("generator", tuple(g_nodes), rpn, g_gpus, 1 if het else None, replica_cpus, g.tp),
                   tuple(ranks), n_train, env.addr(t_nodes[0]), master_port, controller, env.addr(controller),
                   ctrl_port, f"{env.tmp_root.rstrip('/')}/megarl-{env.job_id}.{env.restart_count}", tuple(notes),
                   gen_port, ctrl_cpus, transport, device, tuple(rank_pools))


def placement_lines(cfg, gpus: int, node: str) -> list[str]:
    """One line per role of the device plan (config/placement.py ``DevicePlan``: each field but ``note``),
    as the controller's node ``node`` with ``gpus`` GPUs places it: a role is listed by being in the plan.
    The trainer's ranks and the generator's replicas run in their pools above whatever the plan says."""
    import dataclasses

    from megarl.config.placement import DevicePlan, device_plan

    roles = [f.name for f in dataclasses.fields(DevicePlan) if f.name != "note"]
    try:
        plan = device_plan(cfg, gpus)
    except ValueError as e:
        return [f"device plan roles {', '.join(roles)}: not placeable on {node} ({e})"]
    # trainer and generator always run; an optional role (judge, teacher, critic) only when configured
    reward, algo = getattr(cfg, "reward", None), getattr(cfg, "algorithm", None)
    optional = {"judge": bool(getattr(reward, "model", "")), "teacher": bool(getattr(algo, "teacher", "")),
                "critic": getattr(algo, "advantage", "") in ("gae", "vtrace")}
    ids = {role: getattr(plan, role) for role in roles if optional.get(role, True)}
    return [f"device plan on {node}: " + "; ".join(
        f"{role} {'GPU(s) ' + ','.join(map(str, d)) if d else 'no GPU here (its pool, or the CPU)'}"
        for role, d in ids.items())]


def pick_device(visible: str | None, local_rank: int, gpus_per_node: int, count: int = 1) -> str | None:
    """CUDA_VISIBLE_DEVICES for the task with ``local_rank`` that takes ``count`` devices (a
    trainer rank 1, a replica generator.tp): entries ``[local_rank*count, +count)`` of the node's
    list (srun with --gpus-per-node shows every task the node's GPUs); a task bound to exactly its
    own devices keeps them; None on a CPU pool."""
    if not gpus_per_node:
        return None
    ids = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if len(ids) == count:
        return ",".join(ids)
    lo = local_rank * count
    if ids:
        if lo + count > len(ids):
            raise AllocationError([f"CUDA_VISIBLE_DEVICES={visible!r} has {len(ids)} device(s) but local task "
                                   f"{local_rank} takes [{lo}, {lo + count}): the srun line must request "
                                   f"--gpus-per-node={gpus_per_node}"])
        return ",".join(ids[lo:lo + count])
    return ",".join(str(d) for d in range(lo, lo + count))


def format_srun(lines: Mapping[str, Sequence[str]]) -> str:
    return "\n".join(f"{key}: {shlex.join(cmd)}" for key, cmd in lines.items())


__all__ = ["AllocationError", "SlurmEnv", "RankPool", "RankRole", "Pool", "RoleMap", "build_role_map",
           "compress_nodelist", "format_srun", "job_ports", "parse_nodelist", "pick_device", "placement_lines",
           "rank_pools_needed", "role_ports"]
