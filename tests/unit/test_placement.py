"""Device placement (megarl.config.placement): hand-worked layouts, and the errors that say what
to change. Pure: no GPU needed; the ids reach the processes in test_trainer_executor."""

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.schema import MegaRLConfig
from megarl.config.placement import device_plan
from megarl.utils.devices import cuda_visible


def _cfg(**over):
    """A config object with the layout set (placement does not look at the model)."""
    cfg = MegaRLConfig()
    base = {"trainer.tp": 2, "trainer.pp": 1, "trainer.dp": 2, "generator.tp": 2, "generator.replicas": 2}
    for key, value in {**base, **over}.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_default_is_disjoint_trainer_first():
    plan = device_plan(_cfg(), visible=8)
    assert plan.trainer == [0, 1, 2, 3] and plan.generator == [4, 5, 6, 7]
    assert "disjoint" in plan.note


def test_explicit_lists_and_generator_first():
    plan = device_plan(_cfg(**{"cluster.generator_devices": "0-3"}), visible=8)
    assert plan.generator == [0, 1, 2, 3] and plan.trainer == [4, 5, 6, 7]
    plan = device_plan(_cfg(**{"cluster.trainer_devices": "4,5,6,7", "cluster.generator_devices": "0-3"}), visible=8)
    assert plan.trainer == [4, 5, 6, 7] and plan.generator == [0, 1, 2, 3]


def test_cpu_host_places_nothing():
    plan = device_plan(_cfg(), visible=0)
    assert plan.trainer is None and plan.generator is None


@pytest.mark.parametrize("over,visible,words", [
    ({}, 6, "the generator needs 4 GPU(s)"),
    ({"trainer.dp": 4}, 8, "the generator needs 4 GPU(s) (tp*replicas) and got 0"),
    ({"cluster.trainer_devices": "0-3", "cluster.generator_devices": "3-6"}, 8, "devices [3] are given to both"),
    ({"cluster.trainer_devices": "0-8"}, 8, "device(s) [8] do not exist"),
    ({"cluster.trainer_devices": "1-x"}, 8, "is not a core number or range"),
    ({"cluster.trainer_devices": "0"}, 0, "no CUDA device is visible here"),
])
def test_bad_layouts_say_what_to_change(over, visible, words):
    with pytest.raises(ValueError) as e:
        device_plan(_cfg(**over), visible=visible)
    assert words in str(e.value)


def test_share_devices_puts_both_on_one_gpu():
    """The GPU smoke test's layout: trainer TP1 and a TP1 engine on the one GPU."""
    cfg = _cfg(**{"trainer.tp": 1, "trainer.dp": 1, "generator.tp": 1, "generator.replicas": 1,
                  "cluster.share_devices": True})
    plan = device_plan(cfg, visible=1)
    assert plan.trainer == [0] and plan.generator == [0] and "sharing 0" in plan.note
    # round-robin when sharing fewer devices than workers
    cfg = _cfg(**{"cluster.share_devices": True})
    assert device_plan(cfg, visible=2).trainer == [0, 1, 0, 1]


def test_validation_rejects_overlap_before_anything_starts():
    with pytest.raises(ConfigError, match="given to both the trainer and the generator"):
        load_config("configs/tiny_test.yaml", ["cluster.trainer_devices=0-1", "cluster.generator_devices=1"],
                    )


@pytest.mark.parametrize("visible, ordinals, want", [
    (None, [0, 1], "0,1"),                      # nothing set: the ordinals are the physical ids
    ("", [2], "2"),
    ("4,5,6,7", [0], "4"),                      # a job given GPUs 4-7 runs on them, not on 0-3
    ("4,5,6,7", [2, 3], "6,7"),                 # a TP2 replica's two devices
    (" 3 , 1 ", [1, 0], "1,3"),                 # order and spaces as the user wrote them
    ("GPU-aa11,MIG-bb22", [1], "MIG-bb22"),     # UUIDs pass through
])
def test_a_child_sees_the_plan_ordinal_as_the_controller_sees_it(visible, ordinals, want):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert cuda_visible(ordinals, env) == want


def test_an_ordinal_past_the_visible_devices_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"ordinal\(s\) \[4\] .* 4 device\(s\) .*'4,5,6,7'"):
        cuda_visible([4], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
