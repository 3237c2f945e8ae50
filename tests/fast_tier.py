"""The fast tier (`bash tools/run_tests.sh --fast`): every test that starts no vLLM engine, no
Megatron (rank processes or in-process) and no `megarl` command.

A test is found to start one by reading code, not by running it: the source of the test, of every
fixture it uses (and theirs), and of every function of the tests package it calls (and theirs), is
searched for STARTERS. The reading can miss a starter reached some other way, so under --fast
:func:`guarded` makes such a test fail, naming what it started (then add it to STARTERS).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
import types
from pathlib import Path

# What starts a process of the real stack (or Megatron in this process), as it reads in test code.
STARTERS = ("GeneratorExecutor", "TrainerExecutor", "LocalTrainer", "run_multiprocess", "RewardPool",
            "TeacherExecutor", "JudgeScorer", "CriticExecutor", "CriticLearner", "ProcessGroup", "start_executors",
            "run_job", "reward_executor", "slurm_cluster", "initialize_model_parallel", "init_model_parallel",
            "spawn", "mp.Process", "multiprocessing", "Popen", "subprocess.run", "subprocess.check",
            "torch.distributed.init_process_group", "dist.init_process_group", "vllm", "LLM(",
            "megarl.cli", "cli.main")


@functools.lru_cache(maxsize=None)
def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


TESTS_DIR = str(Path(__file__).resolve().parent)
PACKAGE_DIR = str(Path(__file__).resolve().parents[1] / "megarl")
# What starts a process, as it reads inside megarl itself (a library call a test makes, followed)
LIBRARY_STARTERS = ("get_context(", "run_multiprocess(", "ProcessGroup(", "._group.spawn(", "initialize_model_parallel(",
                    "init_process_group(", '"-m", "megarl"')
_IMPORT = re.compile(r"from ((?:megarl|tests)[\w.]*) import (\([\w,\s]+\)|[\w, ]+)")


def _home(obj) -> str:
    """'tests' or 'megarl' by where ``obj`` is defined, else ''."""
    try:
        path = inspect.getsourcefile(obj) or ""
    except TypeError:
        return ""
    return "tests" if path.startswith(TESTS_DIR) else "megarl" if path.startswith(PACKAGE_DIR) else ""


def _names(code: types.CodeType) -> set:
    """The global names ``code`` and its nested code (functions, lambdas, comprehensions) read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _referenced(fn) -> list:
    """What ``fn`` names: its module globals, and what it imports from megarl or tests inside its body."""
    out = [fn.__globals__.get(name) for name in _names(fn.__code__)]
    for module, names in _IMPORT.findall(_source(fn)):
        try:
            mod = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a module that does not import here starts nothing here
            continue
        out += [getattr(mod, n.split()[0], None) for n in names.strip("()").split(",") if n.strip()]
    return out


def _called_functions(fn, seen: set) -> list:
    """(function or class, home) pairs of the tests folder and of megarl that ``fn`` names, recursively."""
    if getattr(fn, "__code__", None) is None:
        return []
    out = []
    for obj in _referenced(fn):
        obj = inspect.unwrap(obj) if callable(obj) and hasattr(obj, "__wrapped__") else obj  # lru_cache, wraps
        if obj is None or id(obj) in seen or not (inspect.isfunction(obj) or isinstance(obj, type)):
            continue
        home = _home(obj)
        if home:
            seen.add(id(obj))
            out.append((obj, home))
            methods = [m for m in vars(obj).values() if inspect.isfunction(m)] if isinstance(obj, type) else [obj]
            for m in methods:  # a class: what its methods call
                out += _called_functions(m, seen)
    return out


def _starts(obj, home: str) -> bool:
    text = _source(obj)
    return any(s in text for s in (STARTERS if home == "tests" else LIBRARY_STARTERS))


def starts_processes(item) -> bool:
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    seen: set = set()
    found = [(fn, "tests")] + _called_functions(fn, seen)
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        for d in defs:
            if name != "_fast_tier_guard" and id(d.func) not in seen:
                seen.add(id(d.func))
                found += [(d.func, _home(d.func) or "tests")] + _called_functions(d.func, seen)
    return any(_starts(obj, home) for obj, home in found)


# processes of the real stack by the names megarl gives them: Megatron ranks (utils/dist.py, the trainer
# executor, the background checkpoint writer) and vLLM replicas (generator/supervision.py)
ENGINE_OR_MEGATRON = ("megarl-rank", "megarl-trainer", "megarl-gen", "megarl-ckpt-writer")


@contextlib.contextmanager
def guarded(nodeid: str):
    """Inside: starting a Megatron rank or a vLLM replica, or a subprocess that runs megarl or vLLM,
    raises, naming the test (a test the reading above took for a fast one)."""
    import multiprocessing.process
    import subprocess

    def refuse(what):
        raise AssertionError(f"{nodeid} started {what} under --fast: add its starter to tests/fast_tier.py STARTERS")

    start, popen_init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def guarded_start(self, *a, **k):
        if self.name.startswith(ENGINE_OR_MEGATRON):
            refuse(f"a process ({self.name})")
        return start(self, *a, **k)

    def guarded_popen(self, args, *a, **k):
        text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if "-m megarl" in text or "vllm" in text or text.split(" ")[0].endswith("/megarl"):
            refuse(f"a command ({text[:120]})")
        return popen_init(self, args, *a, **k)

    multiprocessing.process.BaseProcess.start = guarded_start
    subprocess.Popen.__init__ = guarded_popen
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start = start
        subprocess.Popen.__init__ = popen_init
