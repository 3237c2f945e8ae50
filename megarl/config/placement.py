"""Where each executor runs: disjoint GPUs for trainer and generator, from ``cluster.*``.

``device_plan`` is pure (unit-tested without a GPU): given the config and the number of visible
devices it returns the device ids of every trainer rank and every generator replica, or None where
an executor stays on the CPU. The ids are ordinals among the devices the controller sees; the executors
turn them into ``CUDA_VISIBLE_DEVICES`` of their own processes before CUDA initialises, as the controller
sees them (``megarl.utils.devices.cuda_visible``: under ``CUDA_VISIBLE_DEVICES=4,5,6,7`` ordinal 0 is
GPU 4), so two executors never land on the same GPU unless the config says they share
(``cluster.share_devices``, e.g. one GPU for both in a smoke test).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megarl.utils.procs import parse_cpu_list


@dataclass(frozen=True)
class DevicePlan:
    trainer: list[int] | None    # one device per trainer rank, in global rank order
    generator: list[int] | None  # generator.tp devices per replica, replica-major
    note: str                    # one line for the log: what went where and why
    judge: list[int] | None = None  # reward.judge_tp devices per judge replica (reward.model), replica-major
    teacher: list[int] | None = None  # one device per teacher rank (algorithm.teacher), in global rank order
    critic: list[int] | None = None  # one device per critic rank (algorithm.advantage gae|vtrace), in global rank order


def needed(cfg) -> tuple[int, int]:
    """(trainer devices, generator devices) the layout needs: one per rank / per engine worker."""
    t, g = cfg.trainer, cfg.generator
    return t.tp * t.pp * t.dp, g.tp * g.replicas


def device_plan(cfg, visible: int) -> DevicePlan:
    """Device ids of trainer ranks and generator workers; raises ValueError saying what to change.

    ``visible``: CUDA devices this process sees (0 on a CPU host: both executors stay on the CPU).
    ``cluster.trainer_devices`` / ``cluster.generator_devices`` (device-list syntax, '0-3,6') pin
    them explicitly; empty means: trainer on the first devices, generator on the next ones.
    """
    c = cfg.cluster
    n_train, n_gen = needed(cfg)
    if c.launcher == "slurm":  # ranks on other nodes take their GPU there (megarl.cluster)
        n_train = 0
    if visible == 0:
        if c.trainer_devices or c.generator_devices:
            raise ValueError(f"cluster.trainer_devices={c.trainer_devices!r} / cluster.generator_devices="
                             f"{c.generator_devices!r}: no CUDA device is visible here; clear them for a CPU run")
        return DevicePlan(None, None, "CPU run: no CUDA device visible")
    train = _parse("cluster.trainer_devices", c.trainer_devices, visible)
    gen = _parse("cluster.generator_devices", c.generator_devices, visible)
    if c.share_devices:
        train = train or list(range(min(n_train, visible)))
        gen = gen or list(range(min(n_gen, visible)))
    else:
        if not train:
            free = [d for d in range(visible) if d not in (gen or [])]
            train = free[:n_train]
        if not gen:
            free = [d for d in range(visible) if d not in train]
            gen = free[:n_gen]
        both = sorted(set(train) & set(gen))
        if both:
            raise ValueError(f"devices {both} are given to both the trainer and the generator; give each its own "
                             f"(cluster.trainer_devices / cluster.generator_devices) or set "
                             f"cluster.share_devices=true")
    if len(train) < n_train and not c.share_devices:
        raise ValueError(f"the trainer needs {n_train} GPU(s) (tp*pp*dp) and got {len(train)} of {visible} visible; "
                         f"lower the trainer's parallel sizes, free devices from the generator, or set "
                         f"cluster.share_devices=true")
    if len(gen) < n_gen and not c.share_devices:
        raise ValueError(f"the generator needs {n_gen} GPU(s) (tp*replicas) and got {len(gen)} of {visible} "
                         f"visible after the trainer's {len(train)}; lower generator.replicas or generator.tp, "
                         f"or set cluster.share_devices=true")
    if n_train == 0:
        return _with_judge(cfg, visible, DevicePlan(None, gen[:n_gen], f"trainer ranks attach from the trainer pool "
                                                    f"(cluster.launcher=slurm); generator workers on GPU(s) "
                                                    f"{_fmt(gen[:n_gen])}"))
    # Shared (or explicitly listed) devices are used round-robin.
    train = [train[r % len(train)] for r in range(n_train)]
    gen = [gen[w % len(gen)] for w in range(n_gen)]
    shared = sorted(set(train) & set(gen))
    note = (f"trainer ranks on GPU(s) {_fmt(train)}, generator workers on GPU(s) {_fmt(gen)}"
            + (f" (sharing {_fmt(shared)}: cluster.share_devices)" if shared else " (disjoint)"))
    return _with_critic(cfg, visible, _with_teacher(cfg, visible, _with_judge(cfg, visible, DevicePlan(train, gen, note))))


def judge_needed(cfg) -> int:
    """GPUs the reward judge needs (reward.judge_tp x judge_replicas; 0 without reward.model)."""
    r = cfg.reward
    return r.judge_tp * r.judge_replicas if r.model else 0


def _with_judge(cfg, visible: int, plan: DevicePlan) -> DevicePlan:
    """``plan`` with the reward judge's devices (reward.model, megarl/reward/judge.py): reward.judge_devices,
    else the devices neither the trainer nor the generator has (with cluster.share_devices: the first ones,
    round-robin); its engines start from the controller, so under Slurm these are the controller node's."""
    n = judge_needed(cfg)
    if not n:
        return plan
    taken = set(plan.trainer or []) | set(plan.generator or [])
    judge = _parse("reward.judge_devices", cfg.reward.judge_devices, visible)
    if cfg.cluster.share_devices:
        judge = judge or list(range(min(n, visible)))
    else:
        both = sorted(set(judge) & taken)
        if both:
            raise ValueError(f"reward.judge_devices={cfg.reward.judge_devices!r}: device(s) {both} are the trainer's or "
                             f"the generator's; give the judge its own or set cluster.share_devices=true")
        judge = judge or [d for d in range(visible) if d not in taken][:n]
        if len(judge) < n:
            raise ValueError(f"the reward judge needs {n} GPU(s) (reward.judge_tp*judge_replicas) and got {len(judge)} "
                             f"of {visible} visible after the trainer's and the generator's; lower reward.judge_tp or "
                             f"reward.judge_replicas, free devices, or set cluster.share_devices=true")
    judge = [judge[w % len(judge)] for w in range(n)]
    return dataclasses.replace(plan, judge=judge, note=f"{plan.note}; reward judge workers on GPU(s) {_fmt(judge)}")


def teacher_needed(cfg) -> int:
    """GPUs the distillation teacher needs: one per rank of its forward-only Megatron executor, which runs
    at the trainer's tp x pp x dp (megarl/teacher/executor.py); 0 without algorithm.teacher."""
    a, t = cfg.algorithm, cfg.trainer
    return t.tp * t.pp * t.dp if a.teacher and a.distill_coef > 0 else 0


def _with_teacher(cfg, visible: int, plan: DevicePlan) -> DevicePlan:
    """``plan`` with the teacher's devices: those no other role has (with cluster.share_devices: the
    trainer's, rank for rank). Its ranks start from the controller (cluster.launcher=local)."""
    n = teacher_needed(cfg)
    if not n:
        return plan
    if cfg.cluster.share_devices:
        teacher = list(plan.trainer or range(min(n, visible)))
    else:
        taken = set(plan.trainer or []) | set(plan.generator or []) | set(plan.judge or [])
        teacher = [d for d in range(visible) if d not in taken][:n]
        if len(teacher) < n:
            raise ValueError(f"the distillation teacher (algorithm.teacher) needs {n} GPU(s) (the trainer's tp*pp*dp) "
                             f"and got {len(teacher)} of {visible} visible after the other roles'; free devices or set "
                             f"cluster.share_devices=true")
    teacher = [teacher[r % len(teacher)] for r in range(n)]
    return dataclasses.replace(plan, teacher=teacher, note=f"{plan.note}; teacher ranks on GPU(s) {_fmt(teacher)}")


def critic_needed(cfg) -> int:
    """GPUs the critic needs: one per rank of its Megatron executor (megarl/critic/executor.py), at
    critic.tp x pp x dp (0 = the trainer's); 0 unless algorithm.advantage is gae or vtrace."""
    critic = getattr(cfg, "critic", None)
    if critic is None or cfg.algorithm.advantage not in ("gae", "vtrace"):
        return 0
    return critic.ranks(cfg.trainer)


def _with_critic(cfg, visible: int, plan: DevicePlan) -> DevicePlan:
    """``plan`` with the critic's devices: those no other role has (with cluster.share_devices: the
    trainer's, round-robin). Its ranks start from the controller (cluster.launcher=local)."""
    n = critic_needed(cfg)
    if not n:
        return plan
    if cfg.cluster.share_devices:
        critic = list(plan.trainer or range(min(n, visible)))
    else:
        taken = set(plan.trainer or []) | set(plan.generator or []) | set(plan.judge or []) | set(plan.teacher or [])
        critic = [d for d in range(visible) if d not in taken][:n]
        if len(critic) < n:
            raise ValueError(f"the critic (algorithm.advantage={cfg.algorithm.advantage}) needs {n} GPU(s) (critic.tp*pp*dp) "
                             f"and got {len(critic)} of {visible} visible after the other roles'; lower critic.dp, free "
                             f"devices or set cluster.share_devices=true")
    critic = [critic[r % len(critic)] for r in range(n)]
    return dataclasses.replace(plan, critic=critic, note=f"{plan.note}; critic ranks on GPU(s) {_fmt(critic)}")


def _parse(key: str, text: str, visible: int) -> list[int]:
    try:
        ids = parse_cpu_list(text)
    except ValueError as e:
        raise ValueError(f"{key}={text!r}: {e}") from None
    bad = [d for d in ids if d >= visible]
    if bad:
        raise ValueError(f"{key}={text!r}: device(s) {bad} do not exist ({visible} visible: 0-{visible - 1})")
    return ids


def _fmt(ids: list[int]) -> str:
    return ",".join(str(d) for d in ids)


__all__ = ["DevicePlan", "critic_needed", "device_plan", "judge_needed", "needed", "teacher_needed"]
