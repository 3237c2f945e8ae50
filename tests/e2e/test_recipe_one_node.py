"""The 8-GPU single-node layout (issue 46): configs/recipes/a3po_qwen3_8b_dapo_math.yaml, an 8B model with the
trainer on GPUs 0-3 (tp 2 x dp 2) and the generator on GPUs 4-7 (4 replicas of tp 1) of one node. Its dry run
(`megarl train RECIPE --dry-run`, no GPU, no weights) places every rank on the GPUs its header names and
plans each role's memory within the node's 80 GB GPUs."""

from __future__ import annotations

import re
from pathlib import Path

from megarl.cli import main
from megarl.config import load_config

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "recipes" / "a3po_qwen3_8b_dapo_math.yaml"
PLAN_LINE = re.compile(r"^#   (trainer|generator), per GPU: +([\d.]+) GB of (\d+)", re.M)
DEVICE_LINE = re.compile(r"^# device plan on one node of (\d+) GPUs .*?: trainer ranks on GPU\(s\) ([\d,]+), "
                         r"generator workers on GPU\(s\) ([\d,]+) \(disjoint\)$", re.M)


def _header_gpus(text: str, role: str) -> list[int]:
    """The GPUs the header's 'GPU layout' gives ``role`` ('#   trainer:   GPUs 0-3, ...')."""
    a, b = re.search(rf"^#   {role}: +GPUs (\d+)-(\d+),", text, re.M).groups()
    return list(range(int(a), int(b) + 1))


def test_the_8b_recipe_runs_on_one_node_of_8_gpus_as_its_header_says(capsys):
    text = RECIPE.read_text()
    assert re.search(r"^# GPU layout: 1 node x 8 H100 80GB\.$", text, re.M)
    cfg = load_config(RECIPE, dry_run=True)
    assert cfg.cluster.launcher == "local" and cfg.cluster.device == "cuda" and not cfg.cluster.share_devices
    assert cfg.cluster.gpu_memory_gb == 80.0
    assert main(["train", str(RECIPE), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # one node: every rank of both executors on it, side by side
    assert re.search(r"^# ranks: trainer tp2 x pp1 x dp2 = 4, generator tp1 x 4 replica\(s\) = 4; 8 GPUs: 1 node\(s\), "
                     r"trainer and generator side by side \(launcher local\)", out, re.M), out[-3000:]
    # the placement the job applies (config/placement.py device_plan) is the header's layout
    node, trainer, generator = DEVICE_LINE.search(out).groups()
    assert int(node) == 8
    assert [int(d) for d in trainer.split(",")] == _header_gpus(text, "trainer") == [0, 1, 2, 3]
    assert [int(d) for d in generator.split(",")] == _header_gpus(text, "generator") == [4, 5, 6, 7]
    # the memory plan of each role fits the node's 80 GB GPU (cluster.gpu_memory_gb), and is an 8B model's:
    # the generator holds Qwen3-8B's 8.19e9 bf16 weights (16.4 GB) whole at tp 1, so it plans more than that
    plan = dict((role, (float(used), float(of))) for role, used, of in PLAN_LINE.findall(out))
    assert list(plan) == ["trainer", "generator"], out[-3000:]
    for used, of in plan.values():
        assert of == 80.0 and 0.0 < used <= of
    assert plan["generator"][0] > 16.4


def test_a_layout_past_the_node_is_refused_by_the_device_plan_line(capsys):
    # trainer dp 4 takes all 8 GPUs: the generator's 4 have no room on the node, so the dry run fails (exit 2)
    # with the device plan's line as the reason
    assert main(["train", str(RECIPE), "trainer.dp=4", "--dry-run"]) == 2
    captured = capsys.readouterr()
    line = re.search(r"^  - device plan: not placeable on one node of 8 GPUs .*$", captured.err, re.M)
    assert line and "the generator needs 4 GPU(s) (tp*replicas) and got 0 of 8 visible after the trainer's 8" \
        in line.group(0), captured.err[-3000:]
    assert not DEVICE_LINE.search(captured.out) and "config OK" not in captured.out
