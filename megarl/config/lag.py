"""``controller.max_policy_lag: auto`` -> an int, from where the executors run (one pure function).

Overlapping the next batch's generation with this step's training only pays when the two run on
their own resources. Sharing every core, they compete: on the quickstart's 2 cores the async run
took 30.2 s a step against the synchronous run's 26.1 s (docs/quickstart_tuning.md). So ``auto`` picks

- **0** (synchronous, every phase on the whole machine) when trainer and generator share every
  core or GPU: on CPU ``cluster.trainer_cpus`` empty (the trainer's ranks use every core), or
  ``generator.threads_bind`` ``auto`` (the engine spreads over every core) or naming a core of
  ``cluster.trainer_cpus``; on GPU ``cluster.share_devices: true``;
- **``controller.async_lag``** (default 1) when they run on their own cores or GPUs.

An explicit number always wins. ``load_config`` applies it (``apply_policy_lag``), so everything
downstream of the loader (the loop, rollouts, the run summary, benches, validation) sees an int;
``controller.lag_choice`` records what was picked and why (logged at start, in the run summary).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.utils.procs import parse_cpu_list

AUTO = "auto"


@dataclass(frozen=True)
class LagChoice:
    lag: int          # the max_policy_lag the run uses (versions)
    requested: str    # "auto" or the number as configured
    reason: str       # why, naming the keys that decided it

    @property
    def mode(self) -> str:
        return "synchronous" if self.lag == 0 else "async"

    def line(self) -> str:
        """One line for the log and the run summary."""
        how = "auto" if self.requested == AUTO else "explicit"
        return f"{self.mode}, max_policy_lag {self.lag} ({how}: {self.reason})"


def generator_cores(threads_bind: str) -> list[int]:
    """Every core named by a ``generator.threads_bind`` like ``'0-1'``, ``'0|1'`` or ``'2;3'``."""
    cores: set[int] = set()
    for replica in threads_bind.split(";"):
        for rank in replica.split("|"):
            cores.update(parse_cpu_list(rank))
    return sorted(cores)


def resolve_policy_lag(max_policy_lag: int | str, async_lag: int, *, on_gpu: bool, trainer_cpus: str = "",
                       threads_bind: str = AUTO, share_devices: bool = False,
                       launcher: str = "local") -> LagChoice:
    """The lag a run uses and why. Pure: reads its arguments only. Raises ValueError naming the key
    on an unreadable core list."""
    if max_policy_lag != AUTO:
        lag = int(max_policy_lag)
        return LagChoice(lag, str(lag), f"controller.max_policy_lag={lag} as configured")
    own = lambda why: LagChoice(async_lag, AUTO, f"{why}; overlap pays, so controller.async_lag={async_lag}")  # noqa: E731
    shared = lambda why: LagChoice(0, AUTO, f"{why}; overlap would only make them compete, so synchronous")  # noqa: E731
    if on_gpu:
        if launcher == "slurm":
            return own("the trainer's ranks run on their own nodes (cluster.launcher=slurm)")
        if share_devices:
            return shared("trainer and generator share GPUs (cluster.share_devices=true)")
        return own("trainer and generator on their own GPUs (cluster.share_devices=false)")
    if not trainer_cpus.strip():
        return shared("cluster.trainer_cpus is empty: the trainer's ranks run on every core, beside the generator")
    try:
        trainer = parse_cpu_list(trainer_cpus)
    except ValueError as e:
        raise ValueError(f"cluster.trainer_cpus={trainer_cpus!r}: {e}") from None
    if threads_bind.strip() == AUTO:
        return shared(f"generator.threads_bind=auto spreads the engine over every core, cluster.trainer_cpus="
                      f"{trainer_cpus!r} included")
    try:
        gen = generator_cores(threads_bind)
    except ValueError as e:
        raise ValueError(f"generator.threads_bind={threads_bind!r}: {e}") from None
    both = sorted(set(trainer) & set(gen))
    if both:
        return shared(f"core(s) {','.join(map(str, both))} are in both cluster.trainer_cpus={trainer_cpus!r} and "
                      f"generator.threads_bind={threads_bind!r}")
    return own(f"trainer on cores {trainer_cpus!r}, generator on {threads_bind!r}: disjoint")


def apply_policy_lag(cfg, on_gpu: bool) -> LagChoice:
    """Resolve ``cfg.controller.max_policy_lag`` in place (an int from here on) and record the choice
    in ``cfg.controller.lag_choice``."""
    c = cfg.controller
    choice = resolve_policy_lag(c.max_policy_lag, c.async_lag, on_gpu=on_gpu, trainer_cpus=cfg.cluster.trainer_cpus,
                                threads_bind=cfg.generator.threads_bind, share_devices=cfg.cluster.share_devices,
                                launcher=cfg.cluster.launcher)
    c.max_policy_lag, c.lag_choice = choice.lag, choice.line()
    return choice


__all__ = ["AUTO", "LagChoice", "apply_policy_lag", "generator_cores", "resolve_policy_lag"]
