"""Config loading: YAML (+ `defaults:` inheritance) + dotted overrides -> validated MegaRLConfig."""

from __future__ import annotations

from pathlib import Path

from megarl.utils.knobs import knob
from megarl.config.loader import ConfigError, apply_overrides, build, describe, load_yaml_tree, to_dict

__all__ = ["ConfigError", "knob", "load_config", "describe", "to_dict"]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, dry_run: bool = False,
                scan_data: bool = True):
    """Load, override, type-check and cross-check a job config. Raises ConfigError listing every
    problem (each naming its key) before anything is started. ``dry_run``: a plan on a machine without
    the weights or the data (megarl/config/validate.py ``check``). ``scan_data=False``: read only the
    data's first rows (its schema), not every row for bad ones: for the tasks of a launched job other
    than the controller, which never read the data (the controller scans it once, before it starts)."""
    from megarl.config.schema import MegaRLConfig
    from megarl.config.lag import apply_policy_lag
    from megarl.config.validate import check, cuda_expected, sync_period_problems

    tree = load_yaml_tree(path) if path else {}
    tree = apply_overrides(tree, overrides or [])
    cfg, problems = build(MegaRLConfig, tree)
    if problems:
        raise ConfigError(problems, str(path or ""))
    problems = check(cfg, dry_run=dry_run, scan_data=scan_data)
    if problems:
        raise ConfigError(problems, str(path or ""))
    from megarl.config.data_choice import apply_data_choice
    from megarl.data.tasks import DataError

    try:  # reward.fn: auto -> the training data's schema reward; data.choice says what was recognised
        apply_data_choice(cfg, missing_ok=dry_run)
    except DataError as e:
        raise ConfigError([str(e)], str(path or "")) from None
    try:  # controller.max_policy_lag: auto -> a number, from the placement (megarl/config/lag.py)
        apply_policy_lag(cfg, on_gpu=cuda_expected(cfg.cluster.device))
    except ValueError as e:
        raise ConfigError([str(e)], str(path or "")) from None
    problems = sync_period_problems(cfg)  # against the lag as resolved
    if problems:
        raise ConfigError(problems, str(path or ""))
    return cfg
