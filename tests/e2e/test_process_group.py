"""The process group under every role (megarl/executors/group.py), alone, with tiny python workers
in real processes: ready, request/reply, a death, a raise, a hang, orderly close, attach mode.

Each worker beats every 0.2 s from a thread and answers ``("ping", n)`` with ``("pong", n, pid)``;
``("die", pid)`` / ``("raise", pid)`` / ``("hang", pid)`` make the worker of that pid exit with code
3, raise, or stop beating and answering (the others answer a pong); ``("nap", pid, s)`` keeps it from
reading for s seconds while it beats.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback

import pytest

from megarl.executors.attach import AttachSpec, accept_ranks, connect
from megarl.executors.base import ExecutorTimeout, ProcessDied
from megarl.executors.group import ProcessGroup, Stalled
from megarl.utils.dist import free_tcp_port

BEAT_S = 0.2
START_S = 60.0  # a spawned interpreter importing this module (and pytest) on a loaded 2-core machine


def _serve(conn, beat_s: float = BEAT_S) -> None:
    lock, frozen = threading.Lock(), threading.Event()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    def beat() -> None:
        while not frozen.wait(beat_s):
            send(("beat",))

    threading.Thread(target=beat, daemon=True).start()
    send(("ready", {"pid": os.getpid()}))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        mine = len(msg) > 1 and msg[1] == os.getpid()
        if msg[0] == "exit":
            return
        if msg[0] == "die" and mine:
            os._exit(3)
        if msg[0] == "raise" and mine:
            try:
                raise ValueError("planted failure")
            except ValueError:
                send(("error", traceback.format_exc()))
                return
        if msg[0] == "hang" and mine:
            frozen.set()
            time.sleep(3600)
        if msg[0] == "nap" and mine:  # busy: beats, reads nothing for a while
            time.sleep(msg[2])
        send(("pong", msg[1], os.getpid()))


def _worker(conn, log_path: str) -> None:
    with open(log_path, "w") as f:
        f.write(f"worker pid {os.getpid()} started\n")
    _serve(conn)


def _attached(port: int, key: bytes) -> None:
    """A process started by someone else (here: plain multiprocessing, standing for srun)."""
    import socket

    conn = connect("127.0.0.1", port, key, timeout_s=START_S)
    conn.send(("hello", {"rank": 0, "host": socket.gethostname(), "pid": os.getpid(), "job": ""}))
    _serve(conn)


def _ready(group: ProcessGroup) -> None:
    def handle(m, msg):
        if msg[0] == "ready":
            m.info = msg[1]

    group.wait(lambda: all(m.info for m in group.members), START_S, "the workers to start", handle,
               check=lambda: group.raise_if_failed("the workers to start"),
               on_timeout=lambda: group.ending(group.hung(group.members, "did not start", "the workers to start")))


@pytest.fixture
def group(tmp_path):
    g = ProcessGroup("testrole", beats=("beat",))
    for i in range(3):
        g.spawn(i, _worker, (str(tmp_path / f"w{i}.log"),), name=f"megarl-test-{i}", log_path=tmp_path / f"w{i}.log")
    _ready(g)
    yield g
    g.discard()


def test_request_reaches_every_worker_and_close_is_orderly(group):
    procs = [m.process for m in group.members]
    replies = group.request(("ping", 7), 30, "pongs")
    assert [(r[0], r[1], r[2]) for r in replies] == [("pong", 7, p.pid) for p in procs]
    group.close(("exit",), timeout_s=30)
    assert [p.exitcode for p in procs] == [0, 0, 0]  # exited when asked, none killed
    assert group.members == []


def test_a_worker_that_dies_is_named_and_every_other_is_killed(group):
    victim = group.members[1]
    procs = [m.process for m in group.members]
    with pytest.raises(ProcessDied) as e:
        group.request(("die", victim.process.pid), 30, "pongs after a death")
    msg = str(e.value)
    assert msg.startswith(f"testrole: testrole process 1 (pid {victim.process.pid}) exited with code 3 while "
                          f"waiting for pongs after a death; every testrole process was killed")
    assert f"worker pid {victim.process.pid} started" in msg  # its log's tail
    assert e.value.component.startswith(f"testrole process 1 (pid {victim.process.pid} on ")
    assert e.value.log_path == str(victim.log_path)
    assert victim.process.exitcode == 3
    assert [p.exitcode for p in procs if p is not victim.process] == [-signal.SIGKILL] * 2  # no orphans


def test_a_worker_that_raises_is_named_with_its_traceback(group):
    victim = group.members[2]
    with pytest.raises(ProcessDied) as e:
        group.request(("raise", victim.process.pid), 30, "pongs after a raise")
    assert f"testrole process 2 (pid {victim.process.pid}) raised ValueError: planted failure" in str(e.value)
    assert e.value.remote_error == "ValueError"
    assert all(m.process.exitcode is not None for m in group.members)


def test_a_worker_that_hangs_is_named_with_the_wait(group):
    victim = group.members[0]
    procs = [m.process for m in group.members]
    t0 = time.monotonic()
    with pytest.raises(ExecutorTimeout) as e:
        # heartbeat timeout 10 beats (2 s): well above one beat, far below the 60 s wait
        group.request(("hang", victim.process.pid), 60, "pongs after a hang", heartbeat_timeout_s=10 * BEAT_S)
    assert time.monotonic() - t0 < 30  # the heartbeat detector caught it, not the 60 s timeout
    msg = str(e.value)
    assert msg.startswith(f"testrole: testrole process 0 (pid {victim.process.pid}) sent nothing for 2s (frozen) "
                          f"while waiting for pongs after a hang")
    assert e.value.component.startswith(f"testrole process 0 (pid {victim.process.pid} on ")
    assert all(p.exitcode == -signal.SIGKILL for p in procs)  # the hung one too


def test_a_wait_past_its_timeout_names_the_silent_worker(group):
    victim = group.members[1]
    with pytest.raises(ExecutorTimeout) as e:
        group.request(("hang", victim.process.pid), 3, "pongs with no heartbeat check")
    assert f"testrole process 1 (pid {victim.process.pid}) did not answer within 3s while waiting for pongs " \
           f"with no heartbeat check" in str(e.value)
    assert "testrole process 0" not in str(e.value).splitlines()[0]  # the ones that answered are not named


def test_a_wait_whose_deadline_passed_unread_still_counts_what_came(group):
    """Replies queued before the deadline, by a caller that was busy elsewhere (the controller awaits
    the trainer while the generator's replicas report ready), end the wait; with nothing queued it
    times out."""
    for m in group.members:
        assert group.send(m, ("ping", 5))
    deadline = time.monotonic() + 30
    while group._inbox.qsize() < 3 and time.monotonic() < deadline:  # the three pongs, unread
        time.sleep(0.05)
    got = []
    group.wait(lambda: len(got) == 3, 0, "pongs read late", lambda m, msg: got.append(msg[:2]),
               on_timeout=lambda: AssertionError("timed out with the pongs queued"))
    assert got == [("pong", 5)] * 3
    with pytest.raises(ExecutorTimeout):
        group.wait(lambda: False, 0, "nothing", lambda m, msg: None,
                   on_timeout=lambda: ExecutorTimeout("nothing came"))


BIG = 8 << 20  # bytes: far more than a pipe holds (socket buffers of ~200 KB), so a write waits for the reader


def _within(seconds: float, fn):
    """``fn()``'s result or exception, failing (not hanging) if it runs past ``seconds``."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_send_to_a_worker_that_hangs_stalls_instead_of_blocking(group):
    """A hung worker's pipe fills: the write would block the caller forever, past every hang check.
    Bounded by stall_s (10 beats: 2 s) of silence, it raises Stalled naming the worker; the others
    still take the same message, and close() does not wait on the stuck channel."""
    victim, others = group.members[0], group.members[1:]
    assert group.send(victim, ("hang", victim.process.pid))
    t0 = time.monotonic()
    with pytest.raises(Stalled) as e:
        _within(60, lambda: group.send(victim, ("ping", 1, b"x" * BIG), stall_s=10 * BEAT_S))
    assert e.value.member is victim and time.monotonic() - t0 >= 10 * BEAT_S
    assert "did not read its channel and sent nothing for 2s (frozen)" in str(e.value)
    for m in others:  # (their bound: a loaded machine may starve a healthy worker's beats for seconds)
        assert _within(90, lambda: group.send(m, ("ping", 2, b"x" * BIG), stall_s=START_S)) is True
    procs = [m.process for m in group.members]
    _within(60, lambda: group.close(("exit",), timeout_s=10 * BEAT_S))  # the exit waits behind the stuck write
    assert procs[0].exitcode == -signal.SIGKILL and all(p.exitcode is not None for p in procs)


def test_a_bounded_send_raises_what_the_write_raised(group):
    """A message that does not pickle raises in the caller, as an unbounded send does, and the
    member's writer goes on with the next message."""
    m = group.members[2]
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        _within(30, lambda: group.send(m, ("ping", 5, lambda: None), stall_s=START_S))
    assert _within(30, lambda: group.send(m, ("ping", 6), stall_s=START_S)) is True


def test_a_send_to_a_busy_worker_that_beats_waits_for_it(group):
    """Not reading is not hanging: a worker that beats while busy (a replica inside an engine step)
    takes the message when it is done, however long past stall_s."""
    m = group.members[1]
    stall_s = 15 * BEAT_S  # 3 s: beats 5x as often, so a loaded machine's delays do not look like a hang
    assert group.send(m, ("nap", m.process.pid, 3 * stall_s))
    t0 = time.monotonic()
    assert _within(60, lambda: group.send(m, ("ping", 3, b"x" * BIG), stall_s=stall_s)) is True
    assert time.monotonic() - t0 > stall_s  # it waited past stall_s: the nap's beats kept it
    deadline, got = time.monotonic() + 30, []
    while ("pong", 3) not in got and time.monotonic() < deadline:  # and it read it whole
        item = group.get(1.0)
        if item is not None and item[0] is m:
            got.append(item[1][:2])
    assert ("pong", 3) in got, got


def test_attach_mode_names_the_lost_connection():
    port, key = free_tcp_port(), b"megarl-test-key"
    launcher = mp.get_context("spawn").Process(target=_attached, args=(port, key), daemon=True)
    launcher.start()
    g = ProcessGroup("testrole", beats=("beat",))
    try:
        (conn, hello), = accept_ranks(AttachSpec(port, key), 1, START_S, role="testrole", unit="worker")
        m = g.attach(0, conn, hello)
        _ready(g)
        assert m.remote and m.process.pid == launcher.pid
        assert g.request(("ping", 1), 30, "a pong")[0][:2] == ("pong", 1)
        os.kill(launcher.pid, signal.SIGKILL)
        with pytest.raises(ProcessDied) as e:
            g.request(("ping", 2), 30, "a pong from a killed worker")
        assert (f"testrole process 0 (pid {launcher.pid} on {hello['host']}) lost its connection to the controller"
                in str(e.value))
    finally:
        g.discard()
        launcher.kill()
        launcher.join(5)


def test_still_waiting_comes_only_when_a_wait_is_unusually_long_for_its_kind(monkeypatch, caplog):
    """The console's "still waiting" line: at SLOW_WAIT_S for a kind of wait not seen finish before (train
    step 1), later at SLOW_WAIT_MEDIANS x the median of its kind (train steps of 15 s: none at 15 s, one at
    45 s), and at debug level only while a preemption is served. A clock of its own: no sleeping."""
    import logging

    from megarl.executors import group as group_mod

    clock = [0.0]
    monkeypatch.setattr(group_mod, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    g = ProcessGroup("trainer")

    def tick(timeout: float):  # nothing arrives: the wait's poll just lets the clock run
        clock[0] += timeout
        return None

    monkeypatch.setattr(g, "get", tick)

    def wait(what: str, lasts: float) -> list[tuple[int, str]]:
        end = clock[0] + lasts
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=group_mod.log.name):
            g.wait(lambda: clock[0] >= end, 600, what, lambda m, msg: None, on_timeout=lambda: AssertionError())
        return [(r.levelno, r.getMessage()) for r in caplog.records if "still waiting" in r.getMessage()]

    assert group_mod.SLOW_WAIT_S == 10.0 and group_mod.SLOW_WAIT_MEDIANS == 3.0
    first = wait("1 trainer rank(s) to answer: train step 1", 15.0)  # no history: at SLOW_WAIT_S
    assert [(lvl, msg.split(" (")[1]) for lvl, msg in first] == [(logging.INFO, "10s so far, 590s left)")]
    assert wait("1 trainer rank(s) to answer: train step 2", 15.0) == []  # as long as the usual: silent
    assert g.slow_after(group_mod.wait_kind("1 trainer rank(s) to answer: train step 9")) == 45.0
    long = wait("1 trainer rank(s) to answer: train step 3", 50.0)
    assert [(lvl, msg) for lvl, msg in long] == [
        (logging.INFO, "trainer: still waiting for 1 trainer rank(s) to answer: train step 3 (45s so far, 555s left)")]
    assert wait("1 trainer rank(s) to answer: save step 3", 12.0)[0][0] == logging.INFO  # another kind: its own
    monkeypatch.setattr(group_mod, "preemption_requested", lambda: True)
    served = wait("1 trainer rank(s) to answer: train step 4", 200.0)
    assert served and {lvl for lvl, _ in served} == {logging.DEBUG}
