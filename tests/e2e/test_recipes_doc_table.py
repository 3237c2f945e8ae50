"""docs/recipes.md's table says what each recipe's dry run plans: the 'planned GB per GPU: trainer / generator'
column is the `megarl train RECIPE --dry-run` memory plan's per-GPU totals, as printed (one decimal), and the
GPU count is the plan's rank count. A change to the accounting (megarl/config/memory.py) that moves a figure
fails here until the table is updated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.cli import main

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `(\w+)\.yaml` \|.*\| (\d+)(?: = [^|]*)?: [^|]*\| ([\d.]+) / ([\d.]+) \|", re.M)
PLAN_LINE = re.compile(r"^#   (trainer|generator), per GPU: +([\d.]+) GB of", re.M)
RANKS = re.compile(r"^# ranks: .*?; (\d+) GPUs:", re.M)
ROWS = ROW.findall((REPO / "docs" / "recipes.md").read_text())


def test_the_table_has_a_row_per_seed_recipe():
    assert {r[0] for r in ROWS} >= {"llamarl_llama31_8b_math", "a3po_qwen3_8b_dapo_math", "a3po_qwen25_15b_gsm8k",
                                    "vaco_qwen25_05b_gsm8k"}


@pytest.mark.parametrize("name,gpus,trainer_gb,generator_gb", ROWS, ids=[r[0] for r in ROWS])
def test_each_row_is_its_dry_run(name, gpus, trainer_gb, generator_gb, capsys):
    assert main(["train", str(REPO / "configs" / "recipes" / f"{name}.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = dict(PLAN_LINE.findall(out))
    # the strings as printed: the dry run rounds to 0.1 GB, the table copies it
    assert (plan["trainer"], plan["generator"]) == (trainer_gb, generator_gb), out[-2500:]
    assert RANKS.search(out).group(1) == gpus
