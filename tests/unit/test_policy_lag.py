"""controller.max_policy_lag: auto -> a number from the placement (megarl/config/lag.py), and an
explicit number always wins. Each row of the table is worked by hand from the rule: 0 when trainer
and generator share every core (CPU) or GPU, controller.async_lag when they run apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.lag import generator_cores, resolve_policy_lag

REPO = Path(__file__).resolve().parents[2]

# (on_gpu, trainer_cpus, threads_bind, share_devices, launcher, async_lag) -> lag
TABLE = [
    pytest.param(False, "", "0-1", False, "local", 1, 0, id="cpu-trainer-unpinned"),
    pytest.param(False, "", "1", False, "local", 1, 0, id="cpu-unpinned-even-if-engine-on-one-core"),
    pytest.param(False, "0", "auto", False, "local", 1, 0, id="cpu-engine-auto-spreads-everywhere"),
    pytest.param(False, "0", "0-1", False, "local", 1, 0, id="cpu-overlap"),
    pytest.param(False, "0-3", "2|3", False, "local", 1, 0, id="cpu-overlap-tp2"),
    pytest.param(False, "0", "1", False, "local", 1, 1, id="cpu-disjoint"),
    pytest.param(False, "0,1", "2|3;4|5", False, "local", 2, 2, id="cpu-disjoint-replicas-async-lag-2"),
    pytest.param(False, "0", "1", True, "local", 1, 1, id="cpu-ignores-share-devices"),
    pytest.param(True, "", "auto", True, "local", 1, 0, id="gpu-shared"),
    pytest.param(True, "", "auto", False, "local", 1, 1, id="gpu-own-devices"),
    pytest.param(True, "", "auto", False, "local", 3, 3, id="gpu-own-devices-async-lag-3"),
    pytest.param(True, "", "auto", True, "slurm", 1, 1, id="gpu-slurm-trainer-on-own-nodes"),
]


@pytest.mark.parametrize("on_gpu,trainer_cpus,bind,share,launcher,async_lag,want", TABLE)
def test_auto_resolution_table(on_gpu, trainer_cpus, bind, share, launcher, async_lag, want):
    c = resolve_policy_lag("auto", async_lag, on_gpu=on_gpu, trainer_cpus=trainer_cpus, threads_bind=bind,
                           share_devices=share, launcher=launcher)
    assert c.lag == want and isinstance(c.lag, int) and c.requested == "auto"
    assert c.mode == ("synchronous" if want == 0 else "async")
    assert c.line().startswith(f"{c.mode}, max_policy_lag {want} (auto: ")


@pytest.mark.parametrize("explicit", [0, 1, 3])
@pytest.mark.parametrize("on_gpu,trainer_cpus,bind,share", [(False, "", "0-1", False), (False, "0", "1", False),
                                                            (True, "", "auto", True), (True, "", "auto", False)])
def test_an_explicit_number_wins(explicit, on_gpu, trainer_cpus, bind, share):
    c = resolve_policy_lag(explicit, 1, on_gpu=on_gpu, trainer_cpus=trainer_cpus, threads_bind=bind,
                           share_devices=share)
    assert c.lag == explicit and c.requested == str(explicit) and "explicit" in c.line()


def test_reasons_name_the_deciding_keys():
    shared = resolve_policy_lag("auto", 1, on_gpu=False, trainer_cpus="0-1", threads_bind="1")
    assert "core(s) 1" in shared.reason and "cluster.trainer_cpus" in shared.reason
    assert "generator.threads_bind" in shared.reason
    assert "cluster.share_devices=true" in resolve_policy_lag("auto", 1, on_gpu=True, share_devices=True).reason


def test_generator_cores():
    assert generator_cores("0-1") == [0, 1] and generator_cores("0|1") == [0, 1]
    assert generator_cores("2-3;4|6") == [2, 3, 4, 6]
    with pytest.raises(ValueError):
        generator_cores("x")


def test_the_loader_resolves_auto_so_everything_downstream_sees_an_int():
    """The quickstart (auto, trainer unpinned, engine on cores 0-1) runs synchronously on a CPU;
    split over the cores it runs at controller.async_lag; a number on the command line wins."""
    qs = str(REPO / "configs" / "quickstart.yaml")
    cpu = ["cluster.device=cpu"]
    cfg = load_config(qs, cpu)
    assert cfg.controller.max_policy_lag == 0 and type(cfg.controller.max_policy_lag) is int
    assert cfg.controller.lag_choice.startswith("synchronous, max_policy_lag 0 (auto: cluster.trainer_cpus is empty")
    cfg = load_config(qs, cpu + ["cluster.trainer_cpus=0", "generator.threads_bind=1", "controller.async_lag=2"])
    assert cfg.controller.max_policy_lag == 2 and cfg.controller.lag_choice.startswith("async, max_policy_lag 2 (auto")
    cfg = load_config(qs, cpu + ["controller.max_policy_lag=1"])
    assert cfg.controller.max_policy_lag == 1 and "explicit" in cfg.controller.lag_choice
    # the bench's sync and async modes set explicit lags on the quickstart's shape
    cfg = load_config(str(REPO / "configs" / "bench_step.yaml"),
                      cpu + ["controller.max_policy_lag=1", "cluster.trainer_cpus=", "generator.threads_bind=0-1"])
    assert cfg.controller.max_policy_lag == 1


def test_bad_values_are_config_errors():
    qs = str(REPO / "configs" / "quickstart.yaml")
    for bad, key in (("controller.max_policy_lag=sometimes", "controller.max_policy_lag"),
                     ("controller.max_policy_lag=-1", "controller.max_policy_lag"),
                     ("controller.async_lag=0", "controller.async_lag")):
        with pytest.raises(ConfigError) as e:
            load_config(qs, ["cluster.device=cpu", bad])
        assert key in str(e.value)
