"""`megarl bench` from an installed megarl: the package alone (a copy of megarl/ in a temporary folder,
no tools/, configs/ or tests/ beside it, the checkout off the path) lists its benches, shows a bench's
options, runs one (``sync --quick --landing-only``: seconds, no model download), and says in one line
that a checkout-only bench (slurm) or a checkout's default config (step) is not there. Break caught: a
bench looked up in the checkout (the old ``REPO_ROOT / "tools" / f"bench_{which}.py"``) fails here,
as it did for every installed megarl."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megarl.bench
from megarl.bench import BENCHES, CHECKOUT_ONLY

REPO = Path(__file__).resolve().parents[2]
HELPERS = {"sync_landing", "shape"}  # modules of megarl.bench that are not benches (no main of their own)


def test_every_listed_bench_is_a_module_with_main():
    for name in BENCHES:
        module = importlib.import_module(f"megarl.bench.{name}")
        assert callable(getattr(module, "main", None)), name
    found = {m.name for m in pkgutil.iter_modules(megarl.bench.__path__)}
    assert found - HELPERS == set(BENCHES), "every bench module is listed (and nothing else)"
    assert not set(CHECKOUT_ONLY) & found  # a checkout-only bench is not in the package


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site, work, env): megarl copied alone into ``site``, an empty working folder, and an environment
    whose path has ``site`` and not the checkout."""
    root = tmp_path_factory.mktemp("installed")
    site, work = root / "site", root / "work"
    shutil.copytree(REPO / "megarl", site / "megarl", ignore=shutil.ignore_patterns("__pycache__"))
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    probe = subprocess.run([sys.executable, "-c", "import json, os, sys, megarl; "
                            "print(json.dumps([megarl.__file__, [os.path.abspath(p) for p in sys.path]]))"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    where, path = json.loads(probe.stdout)
    assert Path(where).resolve() == (site / "megarl" / "__init__.py").resolve()
    assert str(REPO) not in path  # the checkout is not on the path (an editable install's finder maps `megarl` only)
    return site, work, env


def _megarl(installed, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    _, work, env = installed
    return subprocess.run([sys.executable, "-m", "megarl", *args], cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"


def test_bench_help_lists_the_package(installed):
    r = _megarl(installed, "bench", "--help")
    _ok(r)
    for name in [*BENCHES, *CHECKOUT_ONLY]:
        assert f"\n  {name} " in r.stdout, name


def test_a_bench_help_and_run_installed(installed):
    site, work, _ = installed
    r = _megarl(installed, "bench", "sync", "--help")
    _ok(r)
    assert r.stdout.startswith("usage: megarl bench sync") and "--landing-only" in r.stdout
    r = _megarl(installed, "bench", "sync", "--quick", "--landing-only", "--trials", "1", "--out", "out", timeout=300)
    _ok(r)
    fig = json.loads((work / "out" / "sync_landing.json").read_text())
    assert {"fp8", "engine"} <= set(fig) and fig["trainer"] == [2, 1, 1]
    assert not (site / "tools").exists() and not (site / "configs").exists()


def test_checkout_only_and_checkout_config_say_so(installed):
    r = _megarl(installed, "bench", "slurm")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "needs a source checkout" in r.stderr
    r = _megarl(installed, "bench", "step")  # its default config is a checkout's configs/bench_step.yaml
    assert r.returncode == 2
    assert "configs/bench_step.yaml" in r.stderr and "first argument" in r.stderr
