"""Ending a job ends everything it started (megarl.utils.procs and its wiring).

Unit: a child guarded by ``watch_parent`` dies within seconds of its parent's SIGKILL, by either
mechanism (PDEATHSIG, the getppid poll); an unguarded child survives it (the control that proves
the test can fail); ``signals_raise`` turns SIGTERM/SIGINT/SIGHUP into JobInterrupted and restores
the handlers. End to end: a real ``megarl train`` on the tiny model, SIGTERM and SIGKILL of the
controller mid-run; every descendant recorded before the signal is gone 10 s later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from megarl.utils.procs import JobInterrupted, signals_raise

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0
# A SIGTERM'd job checkpoints and closes every executor before it exits: ~4 s on 2 idle cores, 32 s
# measured at load 14 (17 s of it after the last line, the interpreter's exit). The bound from the
# signal to the exit stays under the generator's 30 s shutdown grace, which a controller that waits
# for a replica still loading would spend; every process must be gone GONE_WITHIN_S after the exit.
SIGTERM_EXIT_S = 28.0

# A parent that spawns one child (multiprocessing spawn, like the executors do) and then sleeps;
# the child arms the guard as asked and reports "ready <pid>" on the shared stdout.
PARENT_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, threading, time

    from megarl.utils.procs import spawned_from_main_thread, watch_parent

    def child(mode, parent_pid, pdeathsig, armed):
        if mode == "guard":
            watch_parent(parent_pid, pdeathsig=pdeathsig)
        elif mode == "poll":
            watch_parent(parent_pid, pdeathsig=False)
        armed.set()
        print("ready", os.getpid(), flush=True)
        time.sleep(600)

    def start(mode, box):
        ctx = mp.get_context("spawn")
        armed = ctx.Event()
        p = ctx.Process(target=child, args=(mode, os.getpid(), spawned_from_main_thread(), armed))
        p.start()
        box.append(p)
        armed.wait(60)  # the spawning thread outlives the arming (else the child's parent is
                        # already the main thread when it arms, and a thread exit proves nothing)

    if __name__ == "__main__":
        mode, where = sys.argv[1], sys.argv[2]
        box = []
        if where == "thread":  # a short-lived spawning thread: PDEATHSIG must not fire on its exit
            t = threading.Thread(target=start, args=(mode, box))
            t.start()
            t.join()
        else:
            start(mode, box)
        time.sleep(600)
""")


def _gone(proc: psutil.Process) -> bool:
    """Exited (a zombie counts: nothing runs, only an entry waits for a reaper)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not _gone(p)]
        time.sleep(0.1)
    return [p for p in alive if not _gone(p)]


def _describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{p.pid} (?)")
    return "; ".join(out)


def _kill_quietly(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _read_line(stream, timeout: float) -> str:
    """One line from a pipe, waiting at most ``timeout`` seconds."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"no line within {timeout:.0f}s")
    return box[0]


def _start_family(tmp_path: Path, mode: str, where: str = "main") -> tuple[subprocess.Popen, psutil.Process]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), mode, where], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        line = _read_line(parent.stdout, 60.0)
    except TimeoutError:
        parent.kill()
        parent.wait(10)
        raise
    assert line.startswith("ready "), line
    return parent, psutil.Process(int(line.split()[1]))


@pytest.mark.parametrize("mode", ["guard", "poll"])
def test_guarded_child_dies_with_its_sigkilled_parent(tmp_path, mode):
    parent, child = _start_family(tmp_path, mode)
    try:
        assert child.ppid() == parent.pid
        parent.kill()  # SIGKILL: no handler, no finalizer runs in the parent
        parent.wait(10)
        alive = _wait_gone([child], GONE_WITHIN_S)
        assert not alive, f"child outlived its parent ({mode}): {_describe(alive)}"
    finally:
        _kill_quietly([child])
        parent.kill()
        parent.wait(10)


def test_unguarded_child_survives_its_parent(tmp_path):
    """The control: without the guard the same child is orphaned (what the job did before), so
    the test above measures the guard and not the test's set-up."""
    parent, child = _start_family(tmp_path, "none")
    try:
        parent.kill()
        parent.wait(10)
        still = _wait_gone([child], 3.0)  # the processes still alive after 3 s
        assert still == [child], "an unguarded child died with its parent: the test proves nothing"
        assert child.ppid() != parent.pid  # orphaned, reparented
    finally:
        _kill_quietly([child])
        parent.wait(10)


def test_guard_started_from_a_short_lived_thread_keeps_the_child(tmp_path):
    """PDEATHSIG fires when the spawning *thread* exits: the guard is armed only from the main
    thread, so a child spawned from a finished thread lives on while its parent does, and still
    dies with it (the poll)."""
    parent, child = _start_family(tmp_path, "guard", where="thread")
    try:
        time.sleep(2.0)  # the spawning thread exited right after the child armed its guard
        assert not _gone(child), "the child died with the thread that spawned it"
        parent.kill()
        parent.wait(10)
        alive = _wait_gone([child], GONE_WITHIN_S)
        assert not alive, f"child outlived its parent: {_describe(alive)}"
    finally:
        _kill_quietly([child])
        parent.kill()
        parent.wait(10)


# ---------------------------------------------------------------------------- signals_raise
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_signals_raise_converts_and_restores(sig):
    seen = []
    sentinel = lambda signum, frame: seen.append(signum)  # noqa: E731 -- catches a missing handler
    previous = {s: signal.signal(s, sentinel) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        with pytest.raises(JobInterrupted) as info:
            with signals_raise():
                os.kill(os.getpid(), sig)
                time.sleep(5.0)  # interrupted by the handler's exception at once
        assert info.value.signum == sig and info.value.exit_code == 128 + sig
        assert signal.Signals(sig).name in str(info.value)
        assert not seen, "the signal reached the previous handler while inside signals_raise"
        for s in previous:
            assert signal.getsignal(s) is sentinel, f"{signal.Signals(s).name} handler not restored"
        os.kill(os.getpid(), sig)  # outside: the previous handler again
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [sig]
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def test_signals_raise_is_not_an_exception_and_restores_on_other_errors():
    assert not issubclass(JobInterrupted, Exception)  # `except Exception` must not swallow it
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError):
        with signals_raise():
            assert signal.getsignal(signal.SIGTERM) is not before
            raise ValueError("boom")
    assert signal.getsignal(signal.SIGTERM) is before


def test_signals_raise_off_the_main_thread_is_a_no_op():
    before = signal.getsignal(signal.SIGTERM)
    errors, inside = [], []

    def run():
        try:
            with signals_raise():
                inside.append(signal.getsignal(signal.SIGTERM))
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not errors and inside == [before]


def test_second_signal_while_unwinding_exits_at_once(tmp_path):
    script = tmp_path / "twice.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        from megarl.utils.procs import signals_raise
        with signals_raise():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
            finally:  # a slow cleanup, interrupted by a second signal
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
    """))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert time.monotonic() - t0 < 20
    assert "second signal (SIGINT)" in done.stderr


# ---------------------------------------------------------------------------- end to end
def _job(model_dir: Path, out_dir: Path, log_path: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
           f"model.path={model_dir}", f"logging.out_dir={out_dir}", "controller.steps=1000",
           "controller.eval_every=0", "trainer.checkpoint_interval=0", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def _wait_for(cond, timeout: float, what: str, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; job log:\n"
                         f"{log_path.read_text()[-3000:]}")


def _replicas(controller: psutil.Process) -> list[psutil.Process]:
    """The controller's spawned children (generator replicas; the reward pool has none on the
    tiny config), found by multiprocessing's spawn command line."""
    out = []
    for p in controller.children():
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("when", ["startup", "running"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_the_controller_ends_every_process_of_the_job(tiny_llama_dir, tmp_path, sig, when):
    """``startup``: as soon as the replica process exists (it is loading vLLM and reads no pipe, the
    case the replica's own loop cannot see); ``running``: once the first step is logged.

    SIGKILL gets the tighter bound: the parent watch ends the replica at once (measured 0.5 s),
    while an unguarded replica outlives a SIGKILL at start-up by ~16 s (it notices only when its
    "ready" meets a broken pipe) and a SIGTERM'd controller that waited the generator's 30 s grace
    for a replica still loading took as long."""
    bound = 5.0 if sig == signal.SIGKILL else SIGTERM_EXIT_S + GONE_WITHIN_S
    log_path = tmp_path / "job.log"
    job = _job(tiny_llama_dir, tmp_path / "out", log_path)
    controller = psutil.Process(job.pid)
    descendants: list[psutil.Process] = []
    try:
        if when == "startup":
            _wait_for(lambda: job.poll() is not None or _replicas(controller), 300,
                      "the generator replica process", log_path)
        else:
            _wait_for(lambda: job.poll() is not None or "step 1/1000" in log_path.read_text(), 300,
                      "the job's first step", log_path)
        assert job.poll() is None, log_path.read_text()[-3000:]
        descendants = controller.children(recursive=True)
        assert _replicas(controller), f"no generator replica among {_describe(descendants)}"
        os.kill(job.pid, sig)
        t0 = time.monotonic()
        code = job.wait(60)
        exited = time.monotonic() - t0
        alive = _wait_gone(descendants, max(0.0, bound - (time.monotonic() - t0)))
        assert not alive, (f"{signal.Signals(sig).name} at {when}: still alive {bound:.0f}s "
                           f"later: {_describe(alive)}")
        assert time.monotonic() - t0 < bound + 1
        if sig == signal.SIGTERM:
            assert exited < SIGTERM_EXIT_S, exited
        assert code == (-sig if sig == signal.SIGKILL else 128 + sig), log_path.read_text()[-3000:]
        if sig == signal.SIGTERM:
            text = log_path.read_text()
            assert "received SIGTERM" in text and "interrupted by SIGTERM" in text, text[-3000:]
            last = [ln for ln in text.splitlines() if ln.strip()][-1]  # the console's last line, no traceback
            assert last.startswith("megarl: interrupted by SIGTERM") and last.endswith(
                f"every process of the job was stopped; full log: {tmp_path / 'out' / 'tiny-test' / 'logs' / 'controller.log'}"), \
                text[-3000:]
            assert "Traceback" not in text and "leaked semaphore" not in text, text[-3000:]
    finally:
        _kill_quietly(descendants)
        job.kill()
        job.wait(30)


# A dead executor process is seen through its pipe's EOF at once; the job then closes the other
# executor (trainer.shutdown_timeout_s / the generator's grace, 30 s each by default) at worst.
STOPS_WITHIN_S = 60.0


@pytest.mark.parametrize("victim", ["generator", "trainer"])
def test_a_killed_executor_process_stops_the_async_job_naming_it(tiny_llama_dir, tmp_path, victim):
    """Under the async loop (max_policy_lag 1, the generator working ahead while the trainer
    trains), SIGKILL one vLLM replica or one trainer rank mid-run: the job exits non-zero, its log
    names the dead process with its pid and signal, and no process of the job is alive 10 s later."""
    import re

    log_path = tmp_path / "job.log"
    # generator.max_restarts=0: a dead replica stops the job (by default supervision replaces it and the
    # job goes on: tests/faults/test_generator_faults.py)
    job = _job(tiny_llama_dir, tmp_path / "out", log_path, "controller.max_policy_lag=1", "generator.max_restarts=0")
    controller = psutil.Process(job.pid)
    descendants: list[psutil.Process] = []
    try:
        _wait_for(lambda: job.poll() is not None or "step 2/1000" in log_path.read_text(), 300,
                  "the job's second step", log_path)
        assert job.poll() is None, log_path.read_text()[-3000:]
        descendants = controller.children(recursive=True)
        trainer_pids = [int(p) for p in re.search(r"ready .* pids \[([\d, ]+)\]", log_path.read_text())
                        .group(1).split(",")]
        if victim == "trainer":
            pid = trainer_pids[0]
            named = f"trainer rank 0 (tp 0, pp 0, dp 0; pid {pid}) was killed by signal SIGKILL"
        else:
            pid = next(p.pid for p in _replicas(controller) if p.pid not in trainer_pids)
            named = f"generator replica 0 (pid {pid}) was killed by signal SIGKILL"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        code = job.wait(STOPS_WITHIN_S)
        stopped = time.monotonic() - t0
        alive = _wait_gone(descendants, GONE_WITHIN_S)
        assert not alive, f"{victim} killed: still alive {GONE_WITHIN_S:.0f}s after the job: {_describe(alive)}"
        text = log_path.read_text()
        assert code == 3 and named in text, (code, text[-3000:])  # 3: ExecutorError (megarl/utils/errors.py)
        assert stopped < STOPS_WITHIN_S
        _check_console(text, named, tmp_path / "out" / "tiny-test" / "logs" / "controller.log", victim)
    finally:
        _kill_quietly(descendants)
        job.kill()
        job.wait(30)


def _check_console(text: str, named: str, controller_log: Path, victim: str) -> None:
    """What the user sees after a dead process (docs/errors.md): the console ends in one line naming
    it with its pid and the logs, no traceback, and the resource tracker's "leaked semaphore" (a
    killed child's) went to the controller's log, not after that line. For a replica, its log also
    shows the weights landing without vLLM's "RotaryEmbedding: Failed to load weights"."""
    import re

    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = lines[-1]
    assert last.startswith("megarl: ") and named in last and "(exit 3, " in last, text[-3000:]
    assert f"Full log: {controller_log}" in last and "What to do: " in last, last
    assert "Traceback" not in text and "leaked semaphore" not in text, text[-3000:]
    assert sum(named in ln for ln in lines) <= 2, text[-3000:]  # the executor's ERROR line and the last one
    full = controller_log.read_text()
    assert "Traceback (most recent call last)" in full and named in full
    if victim == "generator":
        own = Path(re.search(r"its own log: (\S+generator_replica0\.log)", last).group(1)).read_text()
        assert own.count("landed in") >= 2, own[-3000:]
        assert "RotaryEmbedding: Failed to load weights" not in own, own[-3000:]
        assert "INFO megarl.generator.weights: vLLM's weight reload warns" in own, own[-3000:]
