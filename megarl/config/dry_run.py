"""What ``megarl train CONFIG --dry-run`` prints and checks: ranks and nodes of every role (the trainer, the
generator, and the job's distillation teacher, critic and reward judge), what is not on this machine, the
data choice, the device plan of a local GPU job and, on GPUs, the memory plan (megarl/config/memory.py for
the trainer and generator, megarl/config/role_memory.py for the other roles). No weights, no torch."""

from __future__ import annotations

import math

from megarl.config.memory import GB, plan_for
from megarl.config.role_memory import critic_memory, judge_memory, teacher_memory


def _local_device_line(cfg, per_node: int) -> tuple[str, bool]:
    """The dry run's device plan of a local job (the controller spawns every executor on its own node): the
    GPUs each role gets on a node of ``per_node`` GPUs (config/placement.py ``device_plan``, the rule the job
    itself applies to the GPUs it sees), or why it cannot be placed there, and whether it can. A Slurm job's
    is the launcher's."""
    from megarl.config.placement import device_plan

    where = (f"one node of {per_node} GPUs (cluster.ranks_per_node"
             f"{'' if cfg.cluster.ranks_per_node else ' 0: 8 assumed'})")
    try:
        return f"device plan on {where}: {device_plan(cfg, per_node).note}", True
    except ValueError as e:
        return f"device plan: not placeable on {where}: {e}", False


def dry_run_report(cfg) -> tuple[list[str], list[str]]:
    """(lines to print, problems) for ``megarl train CONFIG --dry-run``: ranks and nodes, what was
    not on this machine, the data choice, and on GPUs the memory plan. Problems: a local GPU job that
    cannot be placed on one node (the device plan's line), a role whose memory plan does not fit."""
    from megarl.config.validate import absent_paths, cuda_expected, rank_counts

    counts = rank_counts(cfg)
    t, g = cfg.trainer, cfg.generator
    per_node = cfg.cluster.ranks_per_node or 8
    c = cfg.cluster
    roles = [role for role in ("teacher", "critic", "judge") if counts[role]]  # the job's optional roles
    if c.launcher == "slurm":  # separate node pools (docs/slurm.md); the judge runs on the controller's node
        pools = [("trainer", counts["trainer"]), *((r, counts[r]) for r in roles if r != "judge"),
                 ("generator", counts["generator"])]
        nodes = " + ".join(f"{getattr(c, f'{r}_nodes') or math.ceil(n / per_node)} {r}" for r, n in pools) + " node(s)"
    else:  # the controller spawns every executor on its own node
        nodes = f"{math.ceil(counts['gpus'] / per_node)} node(s), {' and '.join(['trainer', 'generator', *roles])} side by side"
    names = {"teacher": "distillation teacher", "critic": "critic", "judge": "reward judge"}
    extra = "".join(f", {names[r]} {counts[r]}" for r in roles)
    on_cuda = cuda_expected(cfg.cluster.device)
    # on the CPU a rank is a process, not a GPU; a local CPU job's nodes are this machine
    unit, slot = ("GPUs", "GPUs") if on_cuda else ("processes", "ranks")
    if not on_cuda and c.launcher != "slurm":
        where = (f" on this machine's CPUs, {' and '.join(['trainer', 'generator', *roles])} side by side "
                 f"(launcher local)")
    else:
        where = (f": {nodes} (launcher {c.launcher}), {per_node} {slot} a node (cluster.ranks_per_node"
                 f"{'' if c.ranks_per_node else ' 0: 8 assumed'})")
    lines = [f"ranks: trainer tp{t.tp} x pp{t.pp} x dp{t.dp} = {counts['trainer']}, generator tp{g.tp} x "
             f"{g.replicas} replica(s) = {counts['generator']}{extra}; {counts['gpus']} {unit}{where}"]
    unplaceable: list[str] = []  # a local job that would stop at its start on a node this size: the line says why
    if cfg.cluster.launcher != "slurm" and on_cuda:
        line, placeable = _local_device_line(cfg, per_node)
        (lines if placeable else unplaceable).append(line)
    lines += [f"not here: {line}" for line in absent_paths(cfg)]
    if cfg.data.choice:
        lines.append(f"data: {cfg.data.choice}")
    if not on_cuda:  # the plan is per GPU; CPU processes share the machine's memory
        why = f"cluster.device={c.device}" + (", no GPU here" if c.device == "auto" else "")
        host = "their nodes'" if c.launcher == "slurm" else "this machine's"
        return lines + [f"memory plan: none: it plans each GPU's memory, and this job runs on the CPU ({why}), its "
                        f"{counts['gpus']} processes sharing {host} memory"], unplaceable
    plan = plan_for(cfg)
    if plan is None:
        return lines + ["memory plan: none (the model's config.json is not here nor in configs/models/)"], unplaceable
    lines.append(f"memory plan against {plan.gpu_bytes / GB:g} GB per GPU ({plan.gpu_source}); estimates, "
                 f"megarl/config/memory.py (role_memory.py for the other roles) says how each is counted:")
    judge_lines, judge_problems = judge_memory(cfg, plan.gpu_bytes)  # reward.model: the judge's engines
    teacher_lines, teacher_problems = teacher_memory(cfg, plan.gpu_bytes)  # algorithm.teacher: forward-only ranks
    critic_lines, critic_problems = critic_memory(cfg, plan.gpu_bytes)  # gae/vtrace: the value model's ranks
    return (lines + [f"  {ln}" for ln in plan.lines() + judge_lines + teacher_lines + critic_lines],
            unplaceable + plan.problems + judge_problems + teacher_problems + critic_problems)


__all__ = ["dry_run_report"]
