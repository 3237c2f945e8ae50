"""A plain `megarl train` (no launcher) that gets SIGTERM, or the first Ctrl-C, checkpoints before it
exits (within cluster.preempt_grace_s), and a rerun of the same command resumes there (trainer.resume_from
defaults to 'auto'): each sample trained once, the steps of metrics.jsonl and trained_samples.jsonl
continuous. A second signal exits at once; a checkpoint that takes longer than the grace time is
abandoned (the process exits by itself). Starting over in a folder that holds a run (--fresh) is
refused in one line unless --overwrite; so is resuming with another model.path or data.train_path.

The signal mechanics (megarl.utils.procs.Preemption with ``requeue=False``) are checked in small
Python processes, the whole path through the CLI on the tiny model (one run SIGTERMed while step 3 of 6
trains, and its rerun: about 2 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, body: str, timeout: float = 30) -> tuple[subprocess.CompletedProcess, float]:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent("""
        import logging, os, signal, sys, time
        logging.basicConfig(level=logging.INFO)
        from megarl.utils.procs import JobInterrupted, Preempted, Preemption, signals_raise
    """) + textwrap.dedent(body))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return done, time.monotonic() - t0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_plain_run_first_signal_asks_for_a_checkpoint_and_exits_128_plus_n(tmp_path, sig):
    """Armed (the loop runs): the first SIGTERM / SIGINT raises nothing by itself; the loop's next
    check raises Preempted, whose exit code is the shell's 128 + N (not the launcher's 75)."""
    done, _ = _script(tmp_path, f"""
        p = Preemption(requeue=False, grace_s=60)
        p.armed = True
        with signals_raise(preemption=p):
            os.kill(os.getpid(), {int(sig)})
            time.sleep(0.2)  # the handler ran and raised nothing: the step in flight goes on
            assert p.requested and p.signum == {int(sig)}
            try:
                p.check()
            except Preempted as exc:
                exc.set_step(2)
                print("EXIT", exc.exit_code, exc)
    """)
    assert done.returncode == 0, done.stderr
    assert f"EXIT {128 + sig} interrupted by {signal.Signals(sig).name}; checkpointed at step 2: rerun the same " \
           f"command to resume" in done.stdout, done.stdout
    assert "checkpointing, then exiting" in done.stderr and "cluster.preempt_grace_s" in done.stderr


def test_plain_run_second_signal_exits_at_once(tmp_path):
    """While the checkpoint is being written (here: a long sleep), a second signal ends the process
    at once with 128 + N, whatever the grace time."""
    done, took = _script(tmp_path, """
        p = Preemption(requeue=False, grace_s=60)
        p.armed = True
        with signals_raise(preemption=p):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # never reached
        print("not stopped")
    """)
    assert done.returncode == 128 + signal.SIGINT, (done.returncode, done.stderr)
    assert "second signal (SIGINT)" in done.stderr and "not stopped" not in done.stdout
    assert took < 10, took


def test_plain_run_exits_by_itself_when_the_grace_time_runs_out(tmp_path):
    """A checkpoint still not written cluster.preempt_grace_s after the signal: the process exits
    128 + N by itself, saying so (a save cut there never counts as complete) and what a rerun does: with
    no checkpoint yet a plain rerun is refused (the run folder holds this run), so it names --overwrite."""
    done, took = _script(tmp_path, f"""
        p = Preemption(requeue=False, grace_s=1.5, checkpoints={str(tmp_path / "checkpoints")!r})
        p.armed = True
        with signals_raise(preemption=p):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a save that never ends
        print("not stopped")
    """)
    assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stderr)
    assert ("no checkpoint within cluster.preempt_grace_s=1.5s of SIGTERM; exiting now (no checkpoint yet: rerun "
            "with --overwrite to start over in the run folder)\n") in done.stderr, done.stderr
    assert 1.4 < took < 10, took


def test_the_grace_time_message_says_where_a_rerun_resumes(tmp_path):
    """The step `latest` names (it moves only once a save is complete, so a save cut by the grace time
    leaves it on the previous one); no `latest`: no checkpoint yet; no folder known: both cases."""
    from megarl.utils.procs import rerun_note

    root = tmp_path / "checkpoints"
    assert rerun_note(root) == "no checkpoint yet: rerun with --overwrite to start over in the run folder"
    root.mkdir()
    (root / "step_00000012").mkdir()  # a save in flight: not in `latest` yet
    assert rerun_note(root) == "no checkpoint yet: rerun with --overwrite to start over in the run folder"
    (root / "latest").write_text("step_00000010\n")
    assert rerun_note(root) == "a rerun resumes from step 10"
    assert rerun_note(None) == ("a rerun resumes from the newest checkpoint; with none yet, rerun with --overwrite "
                                "to start over in the run folder")


def test_plain_run_before_the_loop_a_signal_just_stops(tmp_path):
    """Not armed yet (executors starting): nothing to checkpoint, SIGTERM raises JobInterrupted at
    once (143), and an armed launcher Preemption still exits 75 for a requeue."""
    done, _ = _script(tmp_path, """
        p = Preemption(requeue=False, grace_s=60)
        try:
            with signals_raise(preemption=p):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        except JobInterrupted as exc:
            print("STOP", type(exc).__name__, exc.exit_code)
        q = Preemption()
        with signals_raise(preemption=q):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)  # under a launcher every SIGTERM only asks
            time.sleep(0.2)
            try:
                q.check()
            except Preempted as exc:
                print("LAUNCHER", exc.exit_code)
    """)
    assert done.returncode == 0, done.stderr
    assert "STOP JobInterrupted 143" in done.stdout and "LAUNCHER 75" in done.stdout, done.stdout


# ------------------------------------------------------------------------------ through the CLI
def _cmd(model_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
            f"model.path={model_dir}", f"logging.out_dir={out_dir}", "controller.steps=6",
            "controller.eval_every=0", "trainer.checkpoint_interval=100", *extra]


def _env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_while_step_3_of_6_trains_checkpoints_it_and_the_rerun_resumes(tiny_llama_dir, tmp_path):
    """SIGTERM while step 3 of 6 trains (trainer.checkpoint_interval=100: no scheduled save before the
    end): the step in flight finishes and is logged, the job checkpoints step 3 and exits 143; the rerun
    of the same command resumes at step 3 and trains steps 4-6, each sample once.

    The signal lands inside the step: the trainer rank holds 5 s after step 3's forward and backward,
    before its optimizer update (fault pause ``train_step@3``, megarl/utils/faults.py), and logs so
    first; the test signals after reading that line and checks step 3 was not logged yet."""
    cmd = _cmd(tiny_llama_dir, tmp_path)
    run = tmp_path / "tiny-test"
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                               env=dict(_env(), MEGARL_FAULT_PAUSE="train_step@3=5"))
    try:
        deadline = time.monotonic() + 300
        rank_log = None
        while job.poll() is None and time.monotonic() < deadline:  # the rank says step 3 is running
            found = re.search(r"ready .*? pids \[[\d, ]+\], logs in (\S+)", log_path.read_text())
            rank_log = Path(found.group(1)) / "trainer_rank0.log" if found else None
            if rank_log and rank_log.is_file() and "step 3: forward and backward done" in rank_log.read_text():
                break
            time.sleep(0.05)
        assert job.poll() is None and rank_log is not None, log_path.read_text()[-3000:]
        assert "step 3: forward and backward done" in rank_log.read_text(), "step 3 never ran within 300 s"
        assert _steps(run / "metrics.jsonl") == [1, 2]  # step 3 is in flight, not yet logged
        job.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = job.wait(120)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    text = log_path.read_text()
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert _steps(run / "metrics.jsonl") == [1, 2, 3]  # the step in flight finished
    assert "interrupted: checkpoint of step 3 in place" in text, text[-3000:]
    assert "interrupted by SIGTERM; checkpointed at step 3: rerun the same command to resume" in text, text[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert took < 60, took
    print(f"SIGTERM -> exit {code} in {took:.1f}s")

    # Starting over in that folder is refused in one line naming it, before anything starts; so is a
    # rerun whose data is not the checkpoint's.
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                             for i in range(64)))
    for extra, want in ((["--fresh"], f"run folder {run} holds an earlier run (metrics.jsonl, trained_samples.jsonl, "
                                      f"checkpoints/step_00000003) and this run starts over"),
                        ([f"data.train_path={other}"],
                         f"was trained with data.train_path=builtin:arithmetic, this run has data.train_path={other}")):
        refused = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=300, cwd=REPO, env=_env())
        assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
        line = [x for x in refused.stderr.splitlines() if x.startswith("megarl: ")]
        assert len(line) == 1 and want in line[0] and "--overwrite" in line[0], refused.stderr[-3000:]
        assert "starting the trainer" not in refused.stdout + refused.stderr
    assert _steps(run / "metrics.jsonl") == [1, 2, 3]

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    first = (again.stdout + again.stderr).splitlines()[:3]
    assert any(f"resume: {run} holds a checkpoint at step 3" in x and "resuming at step 3 of 6" in x
               for x in first), first
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (run / "trained_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    ids = [s["id"] for r in rows for s in r["samples"]]
    assert len(ids) == 6 * 4 * 2 and len(set(ids)) == len(ids), "a sample was trained twice"
    # the data stream continued at the saved cursor: no step's prompts came round again
    crcs = [json.loads(line)["data/prompts_crc32"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(set(crcs)) == 6, crcs

    # A kill between step 6's save and its metrics row (the loop logs the row after the save, which it
    # times): the checkpoint holds the row, and the rerun, with nothing left to train, writes it back.
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:-1]))
    last = json.loads(lines[-1])
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "resume: step 6's metrics row, not logged before the job stopped, written from its checkpoint" \
        in out, out[-3000:]
    # a finished run starts nothing (no executor, sync or probe): it says so after the resume line and exits 0
    assert "resuming at step 6 of 6: nothing left to train" in out, out[-3000:]
    assert f"done: the run in {run} is finished (step 6 of 6); nothing to train, so nothing was started" in out, \
        out[-3000:]
    assert "starting the trainer" not in out and "weight sync" not in out and "summary:" not in out, out[-3000:]
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    restored = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert restored == {k: v for k, v in last.items() if k != "checkpoint/seconds"} and "reward/mean" in restored


# ------------------------------------------------------------------- the run folder, no executors
def _cfg(model_dir: Path, tmp_path: Path, *overrides: str):
    from megarl.config import load_config

    return load_config(str(REPO / "configs" / "tiny_test.yaml"),
                       [f"logging.out_dir={tmp_path}", f"model.path={model_dir}", *overrides])


def _earlier_run(tmp_path: Path) -> Path:
    run = tmp_path / "tiny-test"
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003" / "meta.json").write_text('{"step": 3}')  # saved (not verified here)
    (run / "checkpoints" / "latest").write_text("step_00000003\n")
    (run / "tensorboard").mkdir()
    for name in ("metrics.jsonl", "trained_samples.jsonl"):
        (run / name).write_text('{"step": 1}\n')
    (run / "logs").mkdir()
    return run


def test_starting_over_in_a_used_folder_is_refused_unless_overwrite(tiny_llama_dir, tmp_path):
    from megarl.controller.run import RunFolderConflict, claim_run_folder

    run = _earlier_run(tmp_path)
    with pytest.raises(RunFolderConflict) as err:
        claim_run_folder(_cfg(tiny_llama_dir, tmp_path, "trainer.resume_from=null"))
    msg = str(err.value)
    assert "\n" not in msg and f"run folder {run} holds an earlier run" in msg, msg
    assert "To go on, resume it (rerun without --fresh), rerun with --overwrite to start over in it" in msg, msg
    assert "name=tiny-test-2" in msg, msg
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    # --fresh where no step folder was ever saved: resuming is no way on, so the line does not offer it
    (run / "checkpoints" / "step_00000003" / "meta.json").unlink()
    with pytest.raises(RunFolderConflict) as err:
        claim_run_folder(_cfg(tiny_llama_dir, tmp_path, "trainer.resume_from=null"))
    assert "rerun without --fresh" not in str(err.value) and "To go on, rerun with --overwrite" in str(err.value)

    assert claim_run_folder(_cfg(tiny_llama_dir, tmp_path, "trainer.resume_from=null", "logging.overwrite=true")) is None
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    assert left == ["checkpoints", "logs"], left  # metrics, samples, step folders, latest, TensorBoard gone

    # a new folder, or one with only the logs of a run that never trained a step, just starts
    assert claim_run_folder(_cfg(tiny_llama_dir, tmp_path, "trainer.resume_from=null")) is None
    assert claim_run_folder(_cfg(tiny_llama_dir, tmp_path / "new")) is None


def test_auto_without_a_checkpoint_does_not_append_to_an_earlier_run(tiny_llama_dir, tmp_path):
    """'auto' finding nothing complete to resume (a job stopped before its first save) is a start over:
    the same refusal, not a mixed folder, naming only what works (--fresh was not given: not named)."""
    from megarl.controller.run import RunFolderConflict, claim_run_folder

    run = tmp_path / "tiny-test"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunFolderConflict) as err:
        claim_run_folder(_cfg(tiny_llama_dir, tmp_path))
    msg = str(err.value)
    assert msg == (f"run folder {run} holds an earlier run (metrics.jsonl) and no complete checkpoint to resume from: "
                   f"starting over there would mix two runs. To go on, rerun with --overwrite to start over in it "
                   f"(logging.overwrite=true: deletes its metrics, samples and checkpoints), or give this run another "
                   f"name= (e.g. name=tiny-test-2)"), msg
    assert "--fresh" not in msg and "resume it" not in msg


def test_a_finished_run_is_closed_without_starting_anything(tiny_llama_dir, tmp_path):
    """A rerun whose checkpoint is at controller.steps: close_finished_run (loop.py returns 0 on True,
    before any executor starts) rewinds the run folder as a resume does and writes back the last step's
    row from controller_state.json when the job stopped before logging it; a run with steps left is not
    closed (False, nothing touched)."""
    from megarl.controller.run import close_finished_run
    from megarl.controller.state import FILE

    run = tmp_path / "tiny-test"
    cfg = _cfg(tiny_llama_dir, tmp_path, "controller.steps=3", "logging.tensorboard=false")
    step_dir = run / "checkpoints" / "step_00000003"
    step_dir.mkdir(parents=True)
    (step_dir / "meta.json").write_text('{"step": 3}')
    row = {"reward/mean": 0.25, "time/step": 9.5}
    (step_dir / FILE).write_text(json.dumps({"policy_version": 3, "data_seed": cfg.data.seed, "rollouts": {},
                                             "metrics_row": row}))
    rows = lambda *steps: "".join(json.dumps({"step": s}) + "\n" for s in steps)  # noqa: E731
    (run / "metrics.jsonl").write_text(rows(1, 2, 4))  # step 3 never logged; 4: a later run's, not in the checkpoint
    (run / "trained_samples.jsonl").write_text(rows(1, 2, 3, 4))

    longer = _cfg(tiny_llama_dir, tmp_path, "controller.steps=5", "logging.tensorboard=false")
    assert close_finished_run(longer, step_dir) is False
    assert (run / "metrics.jsonl").read_text() == rows(1, 2, 4)  # untouched: the loop's resume does it

    assert close_finished_run(cfg, step_dir) is True
    assert [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 1}, {"step": 2}, {"step": 3, **row}]
    assert (run / "trained_samples.jsonl").read_text() == rows(1, 2, 3)
    assert (run / "metrics.png").is_file()  # the stopped job never drew it
    assert close_finished_run(cfg, step_dir) is True  # again: the row is there, not written twice
    assert _steps(run / "metrics.jsonl") == [1, 2, 3]
