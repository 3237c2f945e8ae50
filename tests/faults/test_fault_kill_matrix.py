"""The seeded kill matrix: a tiny async job (lag 2, partial rollouts cut every 4 tokens, a checkpoint
every step) is killed at a point drawn from a fixed seed, then resumed with trainer.resume_from=auto.

Kinds of kill point (SIGKILL each), each checked by the test where its name says: the controller
after a logged step; the controller while it checkpoints (the staged controller state or the
trainer's temp folder on disk); trainer rank 0 mid-step (after step N's forward and backward, before
its optimizer update: it logs so at a fault pause point, and step N is never logged) and mid-sync
(while the generator's worker holds after receiving the first bytes of weights vN: it logs how many,
and rank 0 never logs "weights vN sent"); a vLLM replica mid-decode (after an engine step that left
requests unfinished under vN-1: it logs 'decoding N request(s)') and mid-landing (after its log line
"landing weights vN", before "weights vN landed": the test checks the second never came); a reward
scoring process while it scores a sample (the run uses a slow import-path reward that marks each
sample it starts). Fault pause points: megarl/utils/faults.py. After the kill the job ends (a killed
controller's processes die with it; a killed rank or a replica killed while landing stops the job
naming it, SIGKILL included), nothing is left running, and the resumed run trains exactly the sample
ids of a run that never stopped, each once. A killed reward worker and a replica killed mid-decode
are the exceptions that do not stop the job: the pool replaces the worker, scores its sample again on
the fresh process and counts it (``reward/worker_deaths``); the generator restarts the replica,
re-syncs it and re-issues its requests (megarl/generator/supervision.py, ``gen/replica_restarts``);
the job finishes with those same ids, each once.

POINTS (20) of the 7 kinds x 4 steps are drawn, every kind at least once. The first drawn point runs
in the default suite, all 20 in the slow one (`-m slow`). SUBSET, the first point of each kind (ids
00, 01, 03, 04, 10, 11, 16: `-m slow -k "00- or 01- or 03- or 04- or 10- or 11- or 16-"`), took
40-130 s a point here, so they would not all fit the default suite's budget. Every wait is bounded.
Bit-identical final weights across kill + resume need controller.deterministic:
tests/faults/test_fault_deterministic.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEED = 21
STEPS = 6
KINDS = ("controller", "controller_in_save", "trainer_mid_step", "trainer_mid_sync", "replica_mid_decode",
         "replica_mid_landing", "reward_worker")
POINTS = 20
COMMON = ("controller.max_policy_lag=2", f"controller.steps={STEPS}", "controller.eval_every=0",
          "generator.round_token_budget=4", "trainer.checkpoint_interval=1", "algorithm.entropy_coef=0.01")
WAIT_S = 300.0   # for a trigger or a job to end (s)
GONE_S = 60.0    # for every process of a killed job to exit (s)


def draw(seed: int = SEED) -> list[tuple[str, int]]:
    """The matrix: POINTS of the (kind, step) pairs, step in 2..STEPS-1 (a checkpoint exists before
    it; the job has a step after it), 7 kinds x 4 steps = 28 to draw from, every kind at least once,
    in an order drawn from a fixed seed."""
    rng = random.Random(seed)
    steps = range(2, STEPS)
    first = [(kind, rng.choice(steps)) for kind in KINDS]  # every kind once
    rest = rng.sample([(k, s) for k in KINDS for s in steps if (k, s) not in first], POINTS - len(first))
    return rng.sample(first + rest, POINTS)


MATRIX = draw()
SUBSET = [next(p for p in MATRIX if p[0] == kind) for kind in KINDS]  # one point of each kind
DEFAULT = MATRIX[0]  # the one point in the default suite (~1.5-2 min with the straight run); the rest: -m slow


# The reward_worker kind scores with this module in the job's scoring processes (reward.fn by import
# path, as users load theirs): it marks each sample it starts (file name: its pid) and takes 0.3 s, so
# the test can SIGKILL a process while it scores. Its samples must finish (a truncated reply is never
# scored), so that run also stops replies at an 'e' (generator.stop); sample ids do not change.
SLOW_REWARD = """
import os, time

def judge(completion, gold, *, strict):
    marks = os.environ["MEGARL_TEST_REWARD_MARKS"]
    open(os.path.join(marks, f"{os.getpid()}-{time.monotonic_ns()}"), "w").close()
    time.sleep(0.3)
    return completion.strip() == gold.strip()
"""
KIND_EXTRA = {"reward_worker": ("reward.fn=matrix_reward:judge", "reward.workers=2", "generator.stop=[e]")}
# The first run's environment per kind (fault pause points, megarl/utils/faults.py). Mid-sync: the
# generator's worker holds 5 s once the first tensor of weights vN has arrived from the trainer (bytes
# moved) and logs how many bytes, so the kill lands inside the transfer, not in one of a few milliseconds
# that a poll would miss. Mid-step: trainer rank 0 holds 5 s after step N's forward and backward, before
# its optimizer update, and logs so.
# Mid-decode: replica 0 holds 5 s after an engine step that left requests unfinished under weights
# v(step - 1) and logs 'decoding N request(s)' first; the test kills it only after reading that line.
# Mid-landing: replica 0 holds 5 s right after it logs 'landing weights vN', before vLLM reloads them
# (the landing itself lasts ~0.1 s on the tiny model: a 2 ms poll could miss it on a loaded machine).
KIND_ENV = {"trainer_mid_sync": lambda step: {"MEGARL_FAULT_PAUSE": f"ddma_received@v{step}=5"},
            "trainer_mid_step": lambda step: {"MEGARL_FAULT_PAUSE": f"train_step@{step}=5"},
            "replica_mid_decode": lambda step: {"MEGARL_FAULT_PAUSE": f"replica_decoding@r0v{step - 1}=5"},
            "replica_mid_landing": lambda step: {"MEGARL_FAULT_PAUSE": f"replica_landing@r0v{step}=5"}}


def _cmd(out_dir: Path, model_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
            f"model.path={model_dir}", f"logging.out_dir={out_dir}", *COMMON, *extra]


def _trained(run: Path) -> dict[int, list[str]]:
    rows = [json.loads(line) for line in (run / "trained_samples.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"a step was recorded twice: {steps}"
    return {r["step"]: [s["id"] for s in r["samples"]] for r in rows}


def _rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait(cond, what: str, proc: subprocess.Popen, timeout: float = WAIT_S, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before {what}"
        time.sleep(poll)
    raise AssertionError(f"no {what} within {timeout:.0f}s")


@pytest.fixture(scope="module")
def straight(tiny_llama_dir, tmp_path_factory):
    """The uninterrupted run every resumed one is compared with: step -> sorted sample ids."""
    out_dir = tmp_path_factory.mktemp("straight")
    done = subprocess.run(_cmd(out_dir, tiny_llama_dir), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {s: sorted(ids) for s, ids in _trained(out_dir / "tiny-test").items()}


def _kill(kind: str, step: int, proc: subprocess.Popen, run: Path, log: Path, side: Path, family: list[int]) -> str:
    """Wait for the point, SIGKILL its process; returns what was killed (for messages). ``side``:
    the replicas' logs (generator.log_dir) and the reward's marks; ``family`` gets the job's processes
    as they were just before the signal."""
    text = lambda: log.read_text(errors="replace") if log.is_file() else ""  # noqa: E731
    ckpts = run / "checkpoints"
    if kind == "controller":
        _wait(lambda: _rows(run) >= step, f"step {step} logged", proc)
        victim = proc.pid
    elif kind == "controller_in_save":
        _wait(lambda: _rows(run) >= step - 1, f"step {step - 1} logged", proc)
        # only a save in progress (its staged controller state or the trainer's temp folder), never a
        # finished step folder: a kill after the save would not be a kill mid-save
        _wait(lambda: any(ckpts.glob(f".stage_step_{step:08d}")) or any(ckpts.glob(f".tmp_step_{step:08d}")),
              f"the step-{step} save in progress", proc, poll=0.002)
        victim = proc.pid
    elif kind == "trainer_mid_step":  # rank 0 says step `step` runs (forward and backward done, no update yet)
        ready = _wait(lambda: re.search(r"trainer: \d+ rank\(s\) ready .*? pids \[([\d, ]+)\], logs in (\S+)",
                                        text()), "the trainer's pids", proc)
        victim = int(ready.group(1).split(",")[0])
        rank_log = Path(ready.group(2)) / "trainer_rank0.log"
        marker = f"trainer rank 0: step {step}: forward and backward done"
        _wait(lambda: rank_log.is_file() and marker in rank_log.read_text(errors="replace"), f"'{marker}'", proc,
              poll=0.01)
    elif kind == "trainer_mid_sync":  # the generator's worker received bytes of weights v`step` from rank 0
        ready = _wait(lambda: re.search(r"trainer: \d+ rank\(s\) ready .*? pids \[([\d, ]+)\], logs in (\S+)",
                                        text()), "the trainer's pids", proc)
        victim = int(ready.group(1).split(",")[0])
        replica_log = side / "gen" / "generator_replica0.log"
        marker = re.compile(rf"received (\d+) bytes of weights v{step} ")
        moved = _wait(lambda: marker.search(replica_log.read_text(errors="replace")) if replica_log.is_file() else None,
                      f"bytes of weights v{step} received", proc, poll=0.01)
        assert int(moved.group(1)) > 0, moved.group(0)
    elif kind == "replica_mid_landing":  # the replica logs this line as it starts landing an update
        replica_log = side / "gen" / "generator_replica0.log"
        marker = re.compile(rf"replica 0 \(pid (\d+)\): landing weights v{step}\b")
        found = _wait(lambda: marker.search(replica_log.read_text(errors="replace")) if replica_log.is_file() else None,
                      f"replica 0 landing weights v{step}", proc, poll=0.01)
        victim = int(found.group(1))
    elif kind == "reward_worker":  # a scoring process that has just started a sample of step `step`
        _wait(lambda: _rows(run) >= step - 1, f"step {step - 1} logged", proc)
        seen = set(os.listdir(side / "marks"))
        fresh = _wait(lambda: sorted(set(os.listdir(side / "marks")) - seen), "a sample being scored", proc,
                      poll=0.005)
        victim = int(fresh[0].split("-")[0])
    else:  # replica_mid_decode: replica 0 says it holds unfinished requests under weights v(step - 1)
        replica_log = side / "gen" / "generator_replica0.log"
        marker = re.compile(rf"replica 0 \(pid (\d+)\): decoding (\d+) request\(s\) at v{step - 1}\b")
        found = _wait(lambda: marker.search(replica_log.read_text(errors="replace")) if replica_log.is_file() else None,
                      f"replica 0 decoding under weights v{step - 1}", proc, poll=0.01)
        assert int(found.group(2)) >= 1, found.group(0)
        victim = int(found.group(1))
    # The job's processes, read before the signal: once the controller is dead its children belong to
    # init, and reading them afterwards would find none (and check nothing).
    family[:] = _descendants(proc.pid)
    assert family, f"{kind}: the job has no child processes to check"
    os.kill(victim, signal.SIGKILL)
    on_disk = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    print(f"killed {kind} pid {victim} at step {step}; checkpoints/ then held {on_disk}")
    return f"{kind} (pid {victim}) at step {step}"


@pytest.mark.parametrize("kind,step", [pytest.param(*p, marks=() if p == DEFAULT else pytest.mark.slow,
                                                    id=f"{i:02d}-{p[0]}-s{p[1]}") for i, p in enumerate(MATRIX)])
def test_kill_then_resume_trains_every_sample_once(kind, step, straight, tiny_llama_dir, tmp_path):
    """Every kill ends the job (a dead reward worker: replaced, counted, the job goes on), leaves
    nothing running, and the resumed run trains exactly the straight run's sample ids, each once."""
    run = tmp_path / "tiny-test"
    log = tmp_path / "first.log"
    side = tmp_path / "side"
    (side / "marks").mkdir(parents=True)
    (side / "matrix_reward.py").write_text(SLOW_REWARD)
    extra = (f"generator.log_dir={side / 'gen'}", *KIND_EXTRA.get(kind, ()))
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGARL_TEST_REWARD_MARKS=str(side / "marks"),
               PYTHONPATH=os.pathsep.join(p for p in (str(side), os.environ.get("PYTHONPATH", "")) if p))
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path, tiny_llama_dir, *extra), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**env, **KIND_ENV.get(kind, lambda step: {})(step)})
        try:
            family: list[int] = []
            what = _kill(kind, step, proc, run, log, side, family)
            code = proc.wait(WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    first = log.read_text(errors="replace")
    deadline = time.monotonic() + GONE_S
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(family), f"{what}: processes left running: {_alive(family)}"
    if kind == "reward_worker":  # replaced, its sample scored again, counted; the job finishes
        assert code == 0, f"{what}: the job did not go on\n{first[-3000:]}"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert sum(r.get("reward/worker_deaths", 0) for r in rows) >= 1, f"{what}: the death was not counted"
        assert "starting another (reward/worker_deaths)" in first, first[-3000:]
    elif kind == "replica_mid_decode":  # restarted in place (megarl/generator/supervision.py); the job finishes
        assert code == 0, f"{what}: the job did not go on\n{first[-3000:]}"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert rows[-1]["gen/replica_restarts"] == 1.0, f"{what}: the restart was not counted"
        assert re.search(r"generator: replica 0 restarted \(cause: was killed by signal SIGKILL", first), first[-3000:]
    else:
        assert code != 0, f"{what}: the job exited 0\n{first[-3000:]}"
        if kind.startswith(("trainer", "replica")):  # the job names the dead process
            assert "SIGKILL" in first, f"{what}: the cause is not named\n{first[-3000:]}"
        if kind == "controller_in_save":  # the save never completed: `latest` still names the step before
            ckpts = run / "checkpoints"
            assert (ckpts / "latest").read_text().strip() == f"step_{step - 1:08d}", \
                f"{what}: latest is {(ckpts / 'latest').read_text()!r}"
            assert not (ckpts / f"step_{step:08d}" / "meta.json").exists(), f"{what}: the save completed"
        if kind == "trainer_mid_step":  # it died inside the step: the step was never logged
            assert f"step {step}/{STEPS} |" not in first, f"{what}: killed after the step"
        if kind == "trainer_mid_sync":  # it died inside the transfer, not after it
            rank_log = re.search(r"logs in (\S+)", first).group(1)
            sent = (Path(rank_log) / "trainer_rank0.log").read_text(errors="replace")
            assert f"DDMA rank 0: weights v{step} sent" not in sent, f"{what}: killed after the transfer"
        if kind == "replica_mid_landing":  # it died before the update landed
            landed = (side / "gen" / "generator_replica0.log").read_text(errors="replace")
            assert f"weights v{step} landed" not in landed, f"{what}: killed after the landing"
        resumed = subprocess.run(_cmd(tmp_path, tiny_llama_dir, "trainer.resume_from=auto", *extra),
                                 capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
        assert resumed.returncode == 0, f"{what}: resume failed\n{resumed.stdout[-3000:]}{resumed.stderr[-3000:]}"
    trained = _trained(run)
    assert sorted(trained) == list(range(1, STEPS + 1)), (what, sorted(trained))
    ids = [i for s in trained.values() for i in s]
    assert len(ids) == len(set(ids)), f"{what}: a sample was trained twice"
    assert {s: sorted(v) for s, v in trained.items()} == straight, f"{what}: trained ids differ from the straight run"


def test_the_matrix_is_seeded_and_covers_every_kind():
    assert draw() == MATRIX and len(MATRIX) == len(set(MATRIX)) == POINTS == 20
    assert {k for k, _ in SUBSET} == set(KINDS) and all(p in MATRIX for p in SUBSET)
    assert all(2 <= s <= STEPS - 1 for _, s in MATRIX)


ASYNC_STEP = 3  # a step with a committed checkpoint before it (step 2) and steps after it
ASYNC_HOLD_S = 60  # the step-ASYNC_STEP writer holds this long after its shards (the kill comes first)


def test_sigkill_during_an_async_write_loses_and_doubles_no_sample(straight, tiny_llama_dir, tmp_path):
    """trainer.async_save: the job is SIGKILLed while the step-3 checkpoint's background writer is
    mid-write (held by the fault pause point after writing its shards, before anything is committed).
    The step-3 checkpoint never counts (`latest` stays on step 2), nothing is left running (the
    writer included), and the resumed run trains exactly the straight run's sample ids, each once."""
    import psutil

    run, log = tmp_path / "tiny-test", tmp_path / "first.log"
    extra = ("trainer.async_save=true",)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path, tiny_llama_dir, *extra), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**env, "MEGARL_FAULT_PAUSE": f"checkpoint_async_write@{ASYNC_STEP}={ASYNC_HOLD_S}"})
        try:
            ready = _wait(lambda: re.search(r"trainer: \d+ rank\(s\) ready .*? pids \[([\d, ]+)\], logs in (\S+)",
                                            log.read_text(errors="replace")), "the trainer's logs", proc)
            rank_log = Path(ready.group(2)) / "trainer_rank0.log"
            marker = re.compile(rf"async writer \(pid (\d+)\) wrote the step-{ASYNC_STEP} shards")
            found = _wait(lambda: marker.search(rank_log.read_text(errors="replace")) if rank_log.is_file() else None,
                          f"the step-{ASYNC_STEP} writer holding mid-write", proc)
            writer = int(found.group(1))
            family = _descendants(proc.pid)
            ckpts = run / "checkpoints"
            assert writer in family and psutil.Process(writer).is_running(), "the writer is not running"
            assert (ckpts / f".tmp_step_{ASYNC_STEP:08d}").is_dir() and not (ckpts / f"step_{ASYNC_STEP:08d}").exists()
            os.kill(proc.pid, signal.SIGKILL)
            code = proc.wait(WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert code == -signal.SIGKILL
    deadline = time.monotonic() + GONE_S
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(family), f"processes left running: {_alive(family)} (the writer: {writer})"
    assert (ckpts / "latest").read_text().strip() == f"step_{ASYNC_STEP - 1:08d}"
    assert not (ckpts / f"step_{ASYNC_STEP:08d}").exists(), "the interrupted write counts as a checkpoint"
    resumed = subprocess.run(_cmd(tmp_path, tiny_llama_dir, *extra), capture_output=True, text=True, timeout=900,
                             cwd=REPO, env=env)
    assert resumed.returncode == 0, f"resume failed\n{resumed.stdout[-3000:]}{resumed.stderr[-3000:]}"
    assert f"step-{ASYNC_STEP - 1} checkpoint" in resumed.stdout + resumed.stderr
    trained = _trained(run)
    assert sorted(trained) == list(range(1, STEPS + 1)), sorted(trained)
    ids = [i for s in trained.values() for i in s]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    assert {s: sorted(v) for s, v in trained.items()} == straight, "trained ids differ from the straight run"
