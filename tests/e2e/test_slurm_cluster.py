"""The project's own sbatch scripts, unchanged, on a real multi-node Slurm cluster (tests/harness/slurm_cluster.py:
munged, slurmctld and 4 slurmd "nodes" n1..n4 on this host, each at its own address, 8 CPUs and 2
"GPUs" that are plain files). Only CPU settings go on the command line (``--gpus-per-node=2``,
``cluster.device=cpu``), plus the job's own knobs (tiny model, async lag 1, steps) and ``--output``
into the test's folder. Each test asserts on what the job wrote: Slurm's job state and exit code,
restart count, metrics rows, trained sample ids and the logs' attach lines.

Cases: 2 trainer nodes (dp 2, one rank per node) + 1 generator node; 1 trainer node + 2 generator
nodes (one replica each, weights to both by DDMA); the heterogeneous job; the time limit's
``--signal=B:USR1@180`` then a real preemption by a higher-priority job (PreemptMode=REQUEUE,
GraceTime 30 s) in one job of three runs (each: checkpoint, requeue, resume; no step lost or trained
twice); a node lost (its trainer rank SIGKILLed: the job ends naming the rank and node, nothing of it
left alive); a node that stops answering (its slurmd, slurmstepd and rank SIGSTOPped: the heartbeat
ends the job in one console line naming the node).

The cluster needs root (and apt to install slurm-wlm once); elsewhere the module skips with the
reason, except under MEGARL_REQUIRE_SLURM=1 (CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A tiny 3-step job took ~90 s from sbatch to COMPLETED on 2 shared cores (vLLM start ~25 s, its first
# generation ~25 s, Megatron ranks ~11 s); 420 s leaves room for a loaded machine and stays below the
# executors' own start timeouts (300 / 600 s), so a hang shows as a failed test naming its state.
JOB_TIMEOUT_S = 420
PROMPTS, SAMPLES = 4, 2  # configs/tiny_test.yaml: controller.prompts_per_step, generator.n_samples


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.harness.slurm_cluster import SlurmCluster, SlurmUnavailable

    try:
        c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=4).up()
    except SlurmUnavailable as e:
        if os.environ.get("MEGARL_REQUIRE_SLURM") == "1":
            raise
        pytest.skip(f"no Slurm test cluster here: {e}")
    yield c
    c.down()


def _overrides(model_dir: Path, out: Path, name: str, *extra: str, steps: int = 3) -> list[str]:
    return [str(REPO / "configs" / "tiny_test.yaml"), f"model.path={model_dir}", "cluster.device=cpu",
            f"logging.out_dir={out}", f"name={name}", "controller.max_policy_lag=1", "controller.eval_every=0",
            f"controller.steps={steps}", *extra]


def _submit(cluster, out: Path, sbatch_args: list[str], script: str, job_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    return cluster.sbatch([*sbatch_args, f"--output={out}/slurm-%j.out", str(REPO / "launch" / "slurm" / script),
                           *job_args], cwd=REPO)


def _finish(cluster, job: int, out: Path, timeout_s: float = JOB_TIMEOUT_S) -> tuple[dict, str]:
    """Wait for the job to end; (its state, its output)."""
    try:
        st = cluster.wait(job, timeout_s)
    except TimeoutError:
        subprocess.run(["scancel", str(job)], env=cluster.env(), capture_output=True, timeout=30)
        raise AssertionError(f"job {job} did not end in {timeout_s}s:\n{_output(out, job)[-6000:]}\n"
                             f"{cluster.log_tail(10)}")
    return st, _output(out, job)


def _output(out: Path, job: int) -> str:
    path = out / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.is_file() else "(no output file)"


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _trained_ids(run: Path) -> list[tuple[int, list[str]]]:
    lines = (run / "trained_samples.jsonl").read_text().splitlines()
    return [(row["step"], [s["id"] for s in row["samples"]]) for row in map(json.loads, lines) if row]


def _expected_ids(step: int) -> list[str]:
    """What any run trains at ``step`` (controller/rollouts.py sample_id): every prompt's group, once."""
    return [f"s{step}p{p}k{k}" for p in range(PROMPTS) for k in range(SAMPLES)]


def _assert_trained_every_step_once(run: Path, steps: int) -> None:
    got = _trained_ids(run)
    assert [s for s, _ in got] == list(range(1, steps + 1)), got
    for step, ids in got:
        assert sorted(ids) == sorted(_expected_ids(step)), (step, ids)
    every = [i for _, ids in got for i in ids]
    assert len(every) == len(set(every)) == steps * PROMPTS * SAMPLES


def _assert_completed(st: dict, text: str) -> None:
    assert (st["state"], st["exit"]) == ("COMPLETED", "0:0"), f"{st}\n{text[-6000:]}"


def test_two_trainer_nodes_and_a_generator_node(cluster, tiny_llama_dir, tmp_path):
    """dp 2 with one rank on each of n1, n2; the replica and the controller on n3; DDMA across nodes."""
    job = _submit(cluster, tmp_path, ["--nodes=3", "--gpus-per-node=2"], "train.sbatch",
                  _overrides(tiny_llama_dir, tmp_path, "two-plus-one", "trainer.dp=2", "cluster.trainer_nodes=2"))
    st, text = _finish(cluster, job, tmp_path)
    _assert_completed(st, text)
    assert "MEGARL_WORLD_SIZE=3 (trainer 2 + generator 1)" in text
    assert re.search(r"trainer: rank 0 attached from pid \d+ on n1", text)
    assert re.search(r"trainer: rank 1 attached from pid \d+ on n2", text)
    assert re.search(r"generator: replica 0 attached from pid \d+ on n3", text)
    assert "DDMA gloo" in text  # chosen from the placement (other nodes), not typed by hand
    assert "--cpus-per-task=" in text  # every srun line asks for its CPUs
    run = tmp_path / "two-plus-one"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/bytes_sent"] > 0 and r["sync/verified"] == 1.0  # checksummed on both sides
        assert r["lag/max"] <= 1
    _assert_trained_every_step_once(run, 3)


@pytest.mark.slow  # CI time: the generator spanning nodes is also in test_two_trainer_nodes_and_a_generator_node's map
def test_one_trainer_node_and_two_generator_nodes(cluster, tiny_llama_dir, tmp_path):
    """The multi-node generator pool: a replica on each of n2, n3 (srun tasks attached to the
    controller on n2); both load every version by DDMA, checksummed."""
    job = _submit(cluster, tmp_path, ["--nodes=3", "--gpus-per-node=2"], "train.sbatch",
                  _overrides(tiny_llama_dir, tmp_path, "one-plus-two", "generator.replicas=2",
                             "cluster.trainer_nodes=1"))
    st, text = _finish(cluster, job, tmp_path)
    _assert_completed(st, text)
    assert "MEGARL_WORLD_SIZE=3 (trainer 1 + generator 2)" in text
    assert re.search(r"generator: replica 0 attached from pid \d+ on n2", text)
    assert re.search(r"generator: replica 1 attached from pid \d+ on n3", text)
    assert "generator: 2 replica(s) ready on n2, n3" in text
    run = tmp_path / "one-plus-two"
    for r in (0, 1):  # each replica received v0..v3 through DDMA (its own log, on the shared run folder)
        log = (run / "logs" / f"generator_replica{r}.log").read_text(errors="replace")
        assert [int(v) for v in re.findall(r"publish weights v(\d+)", log)] == [0, 1, 2, 3], log[-3000:]
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["sync/verified"] == 1.0 for r in rows)
    _assert_trained_every_step_once(run, 3)


@pytest.mark.slow  # CI time: het jobs are a launch variant; preemption and lost nodes stay in every run
def test_heterogeneous_job(cluster, tiny_llama_dir, tmp_path):
    """het.sbatch, its groups sized on the command line: group 0 = n1 (dp 2 on its 2 "GPUs"),
    group 1 = the generator node."""
    job = _submit(cluster, tmp_path, ["--nodes=1", "--gpus-per-node=2", ":", "--nodes=1", "--gpus-per-node=2"],
                  "het.sbatch", _overrides(tiny_llama_dir, tmp_path, "het", "trainer.dp=2"))
    st, text = _finish(cluster, job, tmp_path)
    _assert_completed(st, text)
    assert "heterogeneous job" in text and "--het-group=0" in text and "--het-group=1" in text
    assert re.search(r"trainer: rank 1 attached from pid \d+ on n1", text)
    assert re.search(r"generator: replica 0 attached from pid \d+ on n2", text)
    _assert_trained_every_step_once(tmp_path / "het", 3)


def _runs(text: str) -> list[str]:
    """The job's output split into its runs (each starts with the launcher's restart-count line)."""
    marks = [m.start() for m in re.finditer(r"job \d+: SLURM_RESTART_COUNT=\d+", text)]
    return [text[a:b] for a, b in zip(marks, [*marks[1:], len(text)])]


_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _wait_for(what: str, done, cluster, job: int, out: Path, timeout_s: float = JOB_TIMEOUT_S):
    """Poll ``done()`` (truthy = its value) while the job is pending or running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = done()
        if got:
            return got
        st = cluster.state(job)  # transient states (SIGNALING, REQUEUED, PREEMPTED, COMPLETING) are fine
        assert st["state"] not in _ENDED, f"waiting for {what}: job {st}\n{_output(out, job)[-6000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {what} in {timeout_s}s: job {cluster.state(job)}\n{_output(out, job)[-6000:]}")


def _release_requeued(cluster, job: int, restarts: int, out: Path, *extra: str) -> None:
    """Once the job is back in the queue with ``restarts`` restarts: Slurm holds a requeued job
    ~120 s (Reason=BeginTime); an operator may release it at once, and the test does (with
    ``extra`` scontrol updates), to keep the suite short."""
    def requeued():
        st = cluster.state(job)
        return st["restarts"] >= restarts and st["state"] in ("PENDING", "RUNNING") and st

    st = _wait_for(f"restart {restarts}", requeued, cluster, job, out, timeout_s=180)
    assert st["restarts"] == restarts, st
    if st["state"] == "PENDING":
        # Slurm's hold is what lets the last run's steps end on every node first: released while a
        # slurmstepd of it still runs, the new run lands on that node and dies at once ("Job credential
        # revoked", exit 1, no requeue; CI saw it). So the operator waits for them before releasing.
        _wait_for(f"the steps of job {job}'s last run to end",
                  lambda: not _job_steps(job) or cluster.state(job)["state"] != "PENDING", cluster, job, out,
                  timeout_s=120)
    if cluster.state(job)["state"] == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now", *extra], env=cluster.env(),
                       check=True, capture_output=True, timeout=60)


def _checkpoint_at(run_text: str, signal: str) -> tuple[int, float]:
    """The step a run checkpointed at on ``signal`` and the seconds from the signal to it."""
    assert re.search(rf"received {signal}: checkpointing", run_text), run_text[-6000:]
    m = re.search(r"preempted: checkpoint of step (\d+) in place ([\d.]+)s after the signal", run_text)
    assert m, run_text[-6000:]
    return int(m.group(1)), float(m.group(2))


def test_time_limit_then_preemption_each_checkpoint_requeue_and_lose_no_step(cluster, tiny_llama_dir, tmp_path):
    """One job, three runs, the two ways a Slurm job is stopped for later (40 steps):

    1. **The time limit**: train.sbatch with ``--signal=B:USR1@180``. Once a step is logged its
       limit is cut to at most 3 minutes from now (``scontrol update TimeLimit``: a short ``--time``
       at submission would land the signal before the first step or after the last, depending on
       the machine's speed), so the warning is due at once (slurmctld checks every 30 s). SIGUSR1
       reaches only the batch shell (``B:``): the launcher passes it on, the controller checkpoints,
       and the launcher requeues the job itself (Slurm would not: the job just exits). The operator
       then lifts the limit again for the requeued run.
    2. **A preemption**: a job in partition ``urgent`` (PriorityTier 2, PreemptMode=REQUEUE,
       GraceTime 30 s on ``debug``) needs n1. Slurm SIGTERMs every process of the job at once and
       requeues it when the grace ends: the checkpoint must land inside it.
    3. The run to the end.

    Over the three runs every step is logged once and every step's samples are trained once
    (trained_samples.jsonl, rewound to the checkpoint on resume)."""
    from tests.harness.slurm_cluster import PREEMPT_GRACE_S, URGENT_PARTITION

    # The first run must still be short of the end when the limit's signal lands: up to 30 s (slurmctld's
    # time-limit check period) after the update, ~20 steps at the 1.47 s median step of docs/bench_slurm.json.
    steps = 40
    job = _submit(cluster, tmp_path, ["--nodes=2", "--gpus-per-node=2", "--signal=B:USR1@180"], "train.sbatch",
                  _overrides(tiny_llama_dir, tmp_path, "preempt", "trainer.checkpoint_interval=100", steps=steps))
    run = tmp_path / "preempt"
    metrics = lambda: (run / "metrics.jsonl").is_file() and _rows(run)  # noqa: E731

    # 1. the time limit
    _wait_for("a first step", metrics, cluster, job, tmp_path)
    elapsed = time.time() - _start_time(cluster, job)
    limit_min = int(elapsed // 60) + 3  # ends 120-180 s from now: inside the 180 s warning window
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit_min}"], env=cluster.env(),
                   check=True, capture_output=True, timeout=60)
    _release_requeued(cluster, job, 1, tmp_path, "TimeLimit=UNLIMITED")
    first = _runs(_output(tmp_path, job))[0]
    saved1, save1_s = _checkpoint_at(first, "SIGUSR1")
    assert re.search(r"launch WARNING .*received SIGUSR1", first), first[-6000:]  # the batch shell's signal
    assert f"job {job} requeued: it restarts from its checkpoint" in first, first[-6000:]  # the self-requeue
    assert 1 <= saved1 < steps, saved1
    assert save1_s < 120 - 30, save1_s  # inside the limit: the signal came >= 90 s before it

    # 2. a preemption, once the second run has logged a step of its own
    _wait_for("a step after the resume", lambda: len(metrics() or []) > saved1, cluster, job, tmp_path)
    urgent = cluster.sbatch([f"--partition={URGENT_PARTITION}", "--nodelist=n1", "--nodes=1", "--time=1",
                             f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 2"], cwd=tmp_path)
    _release_requeued(cluster, job, 2, tmp_path)
    assert cluster.wait(urgent, 120)["state"] == "COMPLETED"
    second = _runs(_output(tmp_path, job))[1]
    saved2, save2_s = _checkpoint_at(second, "(SIGTERM|SIGUSR1)")
    assert saved1 < saved2 < steps and save2_s < PREEMPT_GRACE_S, (saved1, saved2, save2_s)

    # 3. to the end
    st, text = _finish(cluster, job, tmp_path, timeout_s=2 * JOB_TIMEOUT_S)
    _assert_completed(st, text)
    assert st["restarts"] == 2, st
    runs = _runs(text)
    assert len(runs) == 3, [r[:80] for r in runs]
    for i, (r, saved) in enumerate(zip(runs[1:], (saved1, saved2)), start=1):
        assert f"SLURM_RESTART_COUNT={i}" in r and f"resuming from the step-{saved} checkpoint" in r, r[-6000:]
    assert [row["step"] for row in _rows(run)] == list(range(1, steps + 1))  # every step logged once
    _assert_trained_every_step_once(run, steps)  # no step lost, none trained twice
    print(f"time limit: USR1 -> checkpoint of step {saved1} in {save1_s:.1f}s; preemption: signal -> "
          f"checkpoint of step {saved2} in {save2_s:.1f}s (GraceTime {PREEMPT_GRACE_S} s)")


def _start_time(cluster, job: int) -> float:
    """The job's StartTime (this run's) as a time.time()."""
    from datetime import datetime

    return datetime.strptime(cluster.sacct(job)[0]["StartTime"], "%Y-%m-%dT%H:%M:%S").timestamp()


def _job_steps(job: int) -> list[int]:
    """The slurmstepd processes of Slurm job ``job`` still alive on any node (all run on this host;
    a step's command line reads 'slurmstepd: [JOB.STEP]')."""
    from tests.harness.procs import alive as _alive

    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith(f"slurmstepd: [{job}.") and _alive(int(proc.name)):
            out.append(int(proc.name))
    return out


def _job_pids(job: int) -> list[int]:
    """Every live process whose environment says it belongs to Slurm job ``job`` (any node: they
    all run on this host), slurmstepd excluded."""
    from tests.harness.procs import alive as _alive
    from tests.harness.slurm_cluster import process_environs

    return [pid for pid, env in process_environs() if env.get("SLURM_JOB_ID") == str(job) and _alive(pid)]


# How long a job's processes may outlive its end: Slurm's KillWait (30 s, the harness's slurm.conf:
# SIGTERM, then SIGKILL after it) plus slack for a node just resumed from SIGSTOP. A fixed 10 s sleep
# raced the cleanup on a loaded machine; a process still there after this is a leak.
JOB_GONE_S = 30 + 15


def _job_pids_after(job: int) -> list[int]:
    """The job's processes still alive once they had JOB_GONE_S to go (polled: usually at once)."""
    deadline = time.monotonic() + JOB_GONE_S
    while (left := _job_pids(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_a_lost_node_ends_the_job_naming_the_rank_and_node(cluster, tiny_llama_dir, tmp_path):
    """SIGKILL the trainer rank on n2 mid-run: the job ends (FAILED) within the heartbeat, naming
    trainer rank 1 and n2, and then no process of the job is alive on any node (JOB_GONE_S)."""
    job = _submit(cluster, tmp_path, ["--nodes=3", "--gpus-per-node=2"], "train.sbatch",
                  _overrides(tiny_llama_dir, tmp_path, "lost", "trainer.dp=2", "cluster.trainer_nodes=2",
                             "cluster.teardown_timeout_s=20", steps=50))
    run = tmp_path / "lost"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    pid = None
    while time.monotonic() < deadline:
        text = _output(tmp_path, job)
        m = re.search(r"trainer: rank 1 attached from pid (\d+) on n2", text)
        if m and (run / "metrics.jsonl").is_file() and _rows(run):
            pid = int(m.group(1))
            break
        assert cluster.state(job)["state"] in ("PENDING", "RUNNING"), text[-4000:]
        time.sleep(0.5)
    assert pid, f"the job never trained a step:\n{_output(tmp_path, job)[-4000:]}"
    t_kill = time.monotonic()
    os.kill(pid, 9)
    st, text = _finish(cluster, job, tmp_path, timeout_s=120)
    ended_s = time.monotonic() - t_kill
    assert st["state"] == "FAILED" and st["exit"] != "0:0", st
    assert re.search(r"trainer rank 1 \(tp 0, pp 0, dp 1; pid \d+ on n2\)", text), text[-6000:]
    # within the heartbeat (trainer.heartbeat_timeout_s) plus the launcher's teardown bound
    assert ended_s < 60 + 2 * 20, ended_s
    left = _job_pids_after(job)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]


def test_a_node_that_stops_answering_ends_the_job_within_the_heartbeat(cluster, tiny_llama_dir, tmp_path):
    """n2 hangs for real: its slurmd, the slurmstepd of the job's step there and the trainer rank on
    it are SIGSTOPped (a hung or unplugged node: no process exits and no connection closes, so only
    the heartbeat can tell). The job's console ends with one line naming trainer rank 1 on n2, what
    to do and the log, within the heartbeat plus the launcher's teardown; no traceback. Then n2
    comes back (SIGCONT), Slurm ends the job's steps there, and no process of the job is left."""
    heartbeat_s, teardown_s = 20, 20
    job = _submit(cluster, tmp_path, ["--nodes=3", "--gpus-per-node=2"], "train.sbatch",
                  _overrides(tiny_llama_dir, tmp_path, "frozen", "trainer.dp=2", "cluster.trainer_nodes=2",
                             f"trainer.heartbeat_timeout_s={heartbeat_s}", f"cluster.teardown_timeout_s={teardown_s}",
                             steps=50))
    run = tmp_path / "frozen"
    _wait_for("a first step", lambda: (run / "metrics.jsonl").is_file() and _rows(run), cluster, job, tmp_path)
    frozen = cluster.node_processes("n2", job)
    assert len(frozen) >= 3, frozen  # slurmd, a slurmstepd, the rank
    t_freeze = time.monotonic()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        def ended():
            lines = [ln for ln in _output(tmp_path, job).splitlines() if ln.strip()]
            return lines and lines[-1].startswith("megarl: ") and "Full log: " in lines[-1] and lines[-1]

        line = _wait_for("last line of the job", ended, cluster, job, tmp_path, timeout_s=180)
        ended_s = time.monotonic() - t_freeze
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    text = _output(tmp_path, job)
    assert re.search(r"trainer rank 1 \(tp 0, pp 0, dp 1; pid \d+ on n2\)", line), text[-6000:]
    assert f"sent no heartbeat for {heartbeat_s}s" in line and "What to do: " in line, line
    assert "Traceback" not in text, text[-6000:]
    # detection (the heartbeat; a step in flight on the other rank waits in its collective) + the
    # controller's report + the launcher's SIGTERM-then-SIGKILL of the pools (teardown, then 10 s)
    assert ended_s < heartbeat_s + 2 * teardown_s + 10 + 30, ended_s
    st = cluster.wait(job, 120)
    assert st["state"] == "FAILED" and st["exit"] != "0:0", st
    left = _job_pids_after(job)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]
    assert _node_state(cluster, "n2") in ("idle", "mix", "alloc"), _node_state(cluster, "n2")  # back for later tests
    print(f"frozen node: the job's last line {ended_s:.0f}s after n2 stopped (heartbeat {heartbeat_s}s)")


def _node_state(cluster, node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True,
                          env=cluster.env(), timeout=30).stdout.strip()
