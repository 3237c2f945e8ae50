"""configs/gpu_smoke.yaml, the first GPU run a user makes: trainer and generator each on a GPU of their own,
passing the dry run with a memory plan on this GPU-less machine (the run itself awaits a GPU)."""

from __future__ import annotations

import re

from megarl.cli import main
from megarl.config import load_config

PLAN_LINE = re.compile(r"#\s+(trainer|generator), per GPU:\s+([\d.]+) GB of ([\d.]+)")


def test_the_gpu_smoke_config_puts_each_executor_on_its_own_gpu_and_fits(capsys):
    cfg = load_config("configs/gpu_smoke.yaml")
    assert cfg.cluster.device == "cuda" and not cfg.cluster.share_devices
    assert (cfg.cluster.trainer_devices, cfg.cluster.generator_devices) == ("0", "1")
    assert main(["train", "configs/gpu_smoke.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = PLAN_LINE.findall(out)
    assert [role for role, _, _ in plan] == ["trainer", "generator"], out[-2000:]
    for _, used, of in plan:
        assert 0.0 < float(used) <= float(of)
    assert "#   weight sync: " in out, out[-2000:]


def test_on_one_gpu_it_shares_as_its_header_says(capsys):
    header = open("configs/gpu_smoke.yaml").read()
    over = re.search(r"^# One GPU only: add (.*)$", header, re.M).group(1).split()
    assert "cluster.share_devices=true" in over
    cfg = load_config("configs/gpu_smoke.yaml", over)
    assert cfg.cluster.trainer_devices == cfg.cluster.generator_devices == "0"
    assert main(["train", "configs/gpu_smoke.yaml", *over, "--dry-run"]) == 0
    plan = PLAN_LINE.findall(capsys.readouterr().out)
    assert sum(float(used) for _, used, _ in plan) <= 80.0, plan  # both fit the one GPU together
