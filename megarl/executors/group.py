"""One process group under every role: the processes an executor drives and their channels.

The trainer's ranks, the generator's replicas and the reward pool's scoring processes are each a
:class:`ProcessGroup`; what a role adds on top is its own protocol (commands, replies, restarts).
The group owns, once for all of them:

* **start or attach** -- :meth:`ProcessGroup.spawn` starts a process here (``spawn`` context, a
  duplex pipe whose child end is the target's first argument); :meth:`ProcessGroup.attach` adopts
  one a launcher started elsewhere (``megarl.executors.attach``: its connection stands for the
  process, EOF for its exit). A member replaced at its index (a restarted replica) keeps the index.
* **messaging** -- one reader thread per member drains its channel into the group's inbox (so a
  member never blocks on a full pipe); :meth:`send` / :meth:`send_bytes` say False when the
  member's end is closed (it died or is dying); given ``stall_s``, they write from the member's own
  writer thread and raise :class:`Stalled` when the member neither reads nor says anything for
  that long (a hung process's pipe fills: the caller would block in the write, past every hang
  check); :meth:`get` takes the next ``(member, message)``; a member's EOF arrives as
  ``(member, ("eof",))``.
* **waits that name what they wait for** -- :meth:`wait` logs ``<role>: waiting up to Ns for
  <what>``, on the console once the wait is unusually long (10 s, or 3x the median of its kind's
  earlier waits) and every 30 s after, and raises the caller's timeout error at the end.
* **one hang detector: heartbeats** -- every message a member sends (the trainer ranks' ``beat``,
  a decoding replica's ``progress``, any reply) sets its ``last_heard``; :meth:`silent` lists the
  members that hold work (the role says which: ``busy``) and were silent longer than the role's
  ``heartbeat_timeout_s``. Heartbeats rather than progress: the trainer cannot report progress
  from inside a collective, while any process can send a message, and a replica's progress
  messages already are heartbeats, so one clock covers both.
* **failure naming the process** -- :func:`member_cause` (how it ended: exit code, signal, or a
  lost connection to a node), :func:`member_where` / :func:`member_component` (pid, node), and
  :meth:`Member.log_tail`: the role builds its :class:`~megarl.executors.base.ProcessDied` /
  :class:`~megarl.executors.base.ExecutorTimeout` from them (component, log_path, remote_error).
* **kill-all and orderly close** -- :meth:`kill_all` (SIGKILL to every process spawned, restarted
  ones too, and their process groups; attached members' connections shut), also run by a finalizer
  on garbage collection and at interpreter exit; :meth:`close` asks members to exit, waits, kills
  the rest.

A member is a :class:`Member` or any object with its attributes (``index``, ``process``, ``conn``,
``remote``, ``log_path``, ``info``, ``last_heard``; e.g. ``megarl.generator.replicas.ReplicaHandle``).
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import pickle
import queue
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from megarl.executors.attach import RemoteProcess, shutdown
from megarl.executors.base import ExecutorTimeout, ProcessDied, exit_cause, kill_processes
from megarl.utils.errors import exception_line, remote_error
from megarl.utils.procs import preemption_requested

log = logging.getLogger(__name__)

POLL_S = 0.25        # waits re-check liveness and hangs this often
SLOW_WAIT_S = 10.0   # a wait says on the console what it waits for once it has lasted this long (DEBUG before)
LOG_EVERY_S = 30.0   # ... and again this often
# ... and, once waits of its kind finished before, not before this many times their median (a factor;
# default 3). Why 3: a kind's work varies with its input (a train step's with its batch's tokens, a save's
# with the write in flight), so a normal wait may take twice the median (a batch of full-length replies
# where the typical one is half as long) and the first few waits estimate the median roughly: 3x is past
# that, so the line means "unusually long", not "a step longer than SLOW_WAIT_S" at every step. The hang
# detectors (heartbeats, timeouts) do not depend on it.
SLOW_WAIT_MEDIANS = 3.0
WAIT_HISTORY = 16    # the latest finished waits of a kind whose median counts (waits; default 16)


class Member:
    """One process of a group and its channel. ``info``: what it said when ready (empty until
    then); ``last_heard``: when it last sent anything (the hang detector's clock)."""

    def __init__(self, index: int, process, conn, log_path: Path | None = None):
        self.index, self.process, self.conn, self.log_path = index, process, conn, log_path
        self.remote = isinstance(process, RemoteProcess)  # attached (started elsewhere), not spawned here
        self.info: dict = {}
        self.last_heard = time.monotonic()

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)


def wait_kind(what: str) -> str:
    """What a wait waits for, without its numbers: ``train step 7`` and ``train step 8`` are one kind."""
    return re.sub(r"\d+", "N", what)


def log_tail(path: Path | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a member's log, or ``(no log)``."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except (OSError, TypeError):
        return "(no log)"


def member_where(m) -> str:
    """``pid N`` (spawned here) or ``pid N on node`` (attached)."""
    return f"pid {m.process.pid} on {m.process.host}" if m.remote else f"pid {m.process.pid}"


def member_node(m) -> str:
    return m.process.host if m.remote else socket.gethostname()


def member_cause(m) -> str:
    """How a member ended, for an error message (an attached one: its connection was lost)."""
    if m.remote and m.process.exitcode not in (None, 0):
        return (f"lost its connection to the controller (the process exited or was killed, or node "
                f"{m.process.host} failed; its srun step reports the exit code)")
    return exit_cause(m.process.exitcode)


class Stalled(ExecutorTimeout):
    """A message to ``member`` that it did not read while it said nothing for ``silent_s`` seconds: it
    hangs, and its channel is unusable (a message half written); the caller fails the member."""

    def __init__(self, member, silent_s: float):
        super().__init__(f"did not read its channel and sent nothing for {silent_s:.0f}s (frozen)")
        self.member, self.silent_s = member, silent_s


class _Writer:
    """A member's writes, in order, on a thread of their own, so the caller's wait stays bounded."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def submit(self, write: Callable[[], None]) -> dict:
        """Queue ``write``; once it ran, the returned dict has ``ok`` (False: the end was closed) or
        ``error`` (what else it raised, e.g. a message that does not pickle), and its event is set."""
        done: dict = {"event": threading.Event()}
        self._jobs.put((write, done))
        return done

    def stop(self) -> None:
        self._jobs.put((None, None))

    def _run(self) -> None:
        while True:
            write, done = self._jobs.get()
            if write is None:
                return
            try:
                write()
                done["ok"] = True
            except OSError:  # closed: by the member's exit, or by ours
                done["ok"] = False
            except BaseException as e:  # noqa: BLE001 - raised in the caller, as an unbounded send would
                done["error"] = e
            finally:
                done["event"].set()


class ProcessGroup:
    """The processes of one role (``role``: the word that starts its log lines and messages).
    ``beats``: message kinds that only say "alive" (noted in ``last_heard``, never queued)."""

    def __init__(self, role: str, *, beats: Collection[str] = ()):
        self.role = role
        self.beats = frozenset(beats)
        self.members: list = []
        self.procs: list = []  # every process spawned here, restarted ones too: kill_all ends what runs
        self.closing = False   # set by close(): an EOF from now on is an orderly exit
        self._inbox: queue.Queue = queue.Queue()
        self._took: dict[str, collections.deque] = {}  # seconds of the finished waits, by kind (wait_kind)
        # Runs on kill_all-less exits too (garbage collection, interpreter exit): nothing outlives
        # the group (each process also watches its parent: megarl.utils.procs.watch_parent).
        self._finalizer = weakref.finalize(self, kill_processes, self.procs)

    # ------------------------------------------------------------------ start or attach
    def spawn(self, index: int, target: Callable, args: tuple = (), kwargs: dict | None = None, *, name: str,
              log_path: Path | None = None, daemon: bool = False, make: Callable = Member):
        """Start ``target(child_conn, *args, **kwargs)`` in a new process as member ``index``
        (``make(index, process, conn, log_path)`` builds the member); returns it."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=target, name=name, args=(child, *args), kwargs=kwargs or {}, daemon=daemon)
        proc.start()
        self.procs[:] = [p for p in self.procs if p.exitcode is None]  # in place: the finalizer holds it
        self.procs.append(proc)
        child.close()
        return self.adopt(make(index, proc, parent, log_path))

    def attach(self, index: int, conn, hello: dict, log_path: Path | None = None, make: Callable = Member):
        """Adopt a process a launcher started elsewhere, from its connection and ``hello``
        (``megarl.executors.attach.accept_ranks``); returns the member."""
        return self.adopt(make(index, RemoteProcess(hello["pid"], hello.get("node") or hello["host"]), conn,
                               log_path))

    def adopt(self, m):
        """Track ``m`` at its index (in place of an earlier member there) and start its reader."""
        if m.index < len(self.members):
            self.members[m.index] = m
        else:
            self.members.append(m)
        threading.Thread(target=self._read, args=(m,), daemon=True,
                         name=f"megarl-{self.role}-reader-{m.index}").start()
        return m

    def current(self, m) -> bool:
        """Whether ``m`` is still the member at its index (not replaced, not closed)."""
        return m.index < len(self.members) and self.members[m.index] is m

    @property
    def pids(self) -> list[int]:
        return [m.process.pid for m in self.members]

    # ------------------------------------------------------------------ messaging
    def _read(self, m) -> None:
        while True:
            try:
                msg = pickle.loads(m.conn.recv_bytes())
            except (EOFError, OSError):
                if m.remote:  # here, not where handled: close() waits for it without reading the inbox
                    m.process.mark_gone(clean=self.closing)
                self._inbox.put((m, ("eof",)))
                return
            m.last_heard = time.monotonic()  # here, not when handled: the caller may not read for a while
            if not (isinstance(msg, tuple) and msg and msg[0] in self.beats):
                self._inbox.put((m, msg))

    def send(self, m, msg: Any, *, stall_s: float | None = None) -> bool:
        """One message to ``m``; False when its end is closed (it died or is dying). ``stall_s``:
        raise :class:`Stalled` when ``m`` neither takes it nor sends anything for that long."""
        return self._write(m, lambda: m.conn.send(msg), stall_s)

    def send_bytes(self, m, data: bytes, *, stall_s: float | None = None) -> bool:
        """Like :meth:`send` for a message pickled once for many members."""
        return self._write(m, lambda: m.conn.send_bytes(data), stall_s)

    def _write(self, m, write: Callable[[], None], stall_s: float | None) -> bool:
        if stall_s is None:
            try:
                write()
                return True
            except OSError:
                return False
        writer = getattr(m, "writer", None)
        if writer is None:
            writer = m.writer = _Writer(f"megarl-{self.role}-writer-{m.index}")
        done, start = writer.submit(write), time.monotonic()
        # a member busy elsewhere (a replica inside an engine step) takes it later, and says so meanwhile
        while not done["event"].wait(POLL_S):
            silent = time.monotonic() - max(m.last_heard, start)
            if silent > stall_s:
                raise Stalled(m, silent)
        if "error" in done:
            raise done["error"]
        return done["ok"]

    def get(self, timeout: float) -> tuple | None:
        """The next ``(member, message)``, waiting up to ``timeout`` seconds; None if none came."""
        try:
            return self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def wait(self, done: Callable[[], bool], timeout: float, what: str, handle: Callable[[Any, tuple], None], *,
             on_timeout: Callable[[], BaseException], check: Callable[[], None] | None = None,
             progress_resets: bool = False, quiet: bool = False) -> None:
        """Handle messages until ``done()``. ``check()`` runs before every look (it raises what
        stops the wait: a death, a hang); after ``timeout`` seconds (counted from the last message
        when ``progress_resets``) ``on_timeout()`` is raised. Says what it waits for in the debug
        log (the files), and on the console once it is unusually long (:meth:`slow_after`), then
        every LOG_EVERY_S (``quiet``: frequent waits whose slowness the caller reports itself; and
        while a preemption is served, which said on the console what it waits for: debug only)."""
        start = time.monotonic()
        kind = wait_kind(what)
        deadline, last_log = start + timeout, start - LOG_EVERY_S + self.slow_after(kind)
        drained_at = None  # the deadline at which the messages already queued were handled
        log.debug("%s: waiting up to %.0fs for %s", self.role, timeout, what)
        while True:
            if check is not None:
                check()
            if done():
                self._took.setdefault(kind, collections.deque(maxlen=WAIT_HISTORY)).append(time.monotonic() - start)
                return
            now = time.monotonic()
            if now >= deadline:
                # what came before the deadline counts: the caller may not have read for a while (another
                # executor's start-up was awaited first); handled once, then looked at like any message
                late = self._inbox.qsize() if drained_at != deadline else 0
                if not late:
                    raise on_timeout()
                drained_at = deadline
                for _ in range(late):
                    item = self.get(0)
                    if item is None:
                        break
                    handle(*item)
                    if progress_resets:
                        deadline = time.monotonic() + timeout
                continue
            if now - last_log > LOG_EVERY_S:
                log.log(logging.DEBUG if quiet or preemption_requested() else logging.INFO,
                        "%s: still waiting for %s (%.0fs so far, %.0fs left)", self.role, what, now - start,
                        deadline - now)
                last_log = now
            item = self.get(min(POLL_S, max(deadline - now, 0.01)))
            if item is not None:
                handle(*item)
                if progress_resets:
                    deadline = time.monotonic() + timeout

    def slow_after(self, kind: str) -> float:
        """Seconds after which a wait of ``kind`` (:func:`wait_kind`) is unusually long: SLOW_WAIT_S, or
        SLOW_WAIT_MEDIANS times the median of the kind's finished waits when that is longer."""
        took = sorted(self._took.get(kind, ()))
        if not took:
            return SLOW_WAIT_S
        mid = len(took) // 2
        median = took[mid] if len(took) % 2 else (took[mid - 1] + took[mid]) / 2
        return max(SLOW_WAIT_S, SLOW_WAIT_MEDIANS * median)

    def request(self, msg: Any, timeout: float, what: str, *, heartbeat_timeout_s: float | None = None) -> list:
        """Send ``msg`` to every member and wait for one reply from each (any message but a beat;
        ``("error", traceback)`` means it raised); the replies in member order. A member that dies,
        raises, or is silent past ``heartbeat_timeout_s`` while others answer, or a wait past
        ``timeout`` seconds, kills every member and raises :class:`ProcessDied` /
        :class:`ExecutorTimeout` naming the process and ``what``. The plain protocol for a role
        that needs no other (the trainer and generator speak their own over the same channel)."""
        members, replies = list(self.members), {}
        for m in members:
            if not self.send(m, msg):
                m.process.join(2.0)
                raise self.ending(self.died(m, member_cause(m), what))

        def handle(m, reply: tuple) -> None:
            if not self.current(m):
                return
            if reply[0] == "eof":
                m.process.join(2.0)
                raise self.ending(self.died(m, member_cause(m), what))
            if reply[0] == "error":
                raise self.ending(self.died(m, f"raised {exception_line(reply[1]) or 'an error'}", what, reply[1]))
            replies[m.index] = reply

        def check() -> None:
            if self.exited():  # what it sent before dying first (its traceback names the cause)
                deadline = time.monotonic() + 1.0
                while (item := self.get(max(deadline - time.monotonic(), 0.0))) is not None:
                    handle(*item)
                self.raise_if_failed(what)
            if heartbeat_timeout_s is not None:
                frozen = self.silent(heartbeat_timeout_s, lambda m: m.index not in replies)
                if frozen:
                    raise self.ending(self.hung(frozen, f"sent nothing for {heartbeat_timeout_s:.0f}s (frozen)",
                                                what))

        self.wait(lambda: len(replies) == len(members), timeout, what, handle, check=check,
                  on_timeout=lambda: self.ending(self.hung([m for m in members if m.index not in replies],
                                                           f"did not answer within {timeout:.0f}s", what)))
        return [replies[m.index] for m in members]

    # ------------------------------------------------------------------ failures
    def label(self, m) -> str:
        return f"{self.role} process {m.index} ({member_where(m)})"

    def died(self, m, cause: str, what: str, tb: str = "") -> ProcessDied:
        """The error naming member ``m``, how it ended (``cause``; ``tb``: its traceback when it
        raised) and what was waited for; with component, log_path and remote_error set."""
        body = tb.rstrip() or (f"--- last lines of {m.log_path} ---\n{log_tail(m.log_path)}" if m.log_path
                               else "(no log)")
        exc = ProcessDied(f"{self.role}: {self.label(m)} {cause} while waiting for {what}; every {self.role} "
                          f"process was killed\n{body}")
        exc.component = f"{self.role} process {m.index} (pid {m.process.pid} on {member_node(m)})"
        exc.log_path = str(m.log_path) if m.log_path else None
        exc.remote_error = remote_error(tb) if tb else None
        return exc

    def hung(self, silent: list, why: str, what: str) -> ExecutorTimeout:
        """The error naming the ``silent`` members, ``why`` and what was waited for."""
        now = time.monotonic()
        lines = "\n".join(f"  {self.label(m)}: last heard {now - m.last_heard:.1f}s ago; last lines of "
                          f"{m.log_path}:\n{log_tail(m.log_path, 8)}" for m in silent)
        exc = ExecutorTimeout(f"{self.role}: {', '.join(self.label(m) for m in silent)} {why} while waiting for "
                              f"{what}\n{lines}")
        exc.component = ", ".join(f"{self.role} process {m.index} (pid {m.process.pid} on {member_node(m)})"
                                  for m in silent)
        exc.log_path = str(silent[0].log_path) if silent and silent[0].log_path else None
        return exc

    def ending(self, exc: BaseException) -> BaseException:
        """Kill every member (their shared state is unusable, no orphans), log, return ``exc`` to raise."""
        log.error("%s", str(exc).splitlines()[0])
        self.kill_all()
        return exc

    def raise_if_failed(self, what: str) -> None:
        """Raise (killing every member) :class:`ProcessDied` for the first member that exited."""
        for m in self.exited():
            raise self.ending(self.died(m, member_cause(m), what))

    # ------------------------------------------------------------------ hangs and deaths
    def silent(self, timeout_s: float, busy: Callable[[Any], bool] = lambda m: bool(m.info)) -> list:
        """The hang detector: members that hold work (``busy``) and sent nothing (no heartbeat,
        no reply) for more than ``timeout_s`` seconds."""
        now = time.monotonic()
        return [m for m in self.members if busy(m) and now - m.last_heard > timeout_s]

    def exited(self) -> list:
        """Members whose process has exited (an attached one: whose connection closed)."""
        return [m for m in self.members if m.process.exitcode is not None]

    # ------------------------------------------------------------------ ending
    def kill(self, m) -> None:
        """SIGKILL one member (with its process group) and close its channel."""
        kill_processes([m.process])
        if m.remote:
            shutdown(m.conn)
        m.conn.close()
        if getattr(m, "writer", None) is not None:
            m.writer.stop()

    def kill_all(self) -> None:
        """SIGKILL every process spawned here; shut the attached members' connections (they exit
        on the EOF). Safe to call repeatedly."""
        kill_processes(self.procs)
        for m in self.members:
            if m.remote and not m.conn.closed:
                shutdown(m.conn)

    def close(self, exit_msg: Any, timeout_s: float, *, leaving: Callable[[Any], bool] = lambda m: True,
              knob: str = "shutdown_timeout_s") -> list:
        """Ask the members for which ``leaving(m)`` (those able to read: started) to exit with
        ``exit_msg``, wait up to ``timeout_s`` for them, kill everything left, close every channel;
        returns the members it held. Idempotent."""
        self.closing = True
        going = [m for m in self.members if leaving(m)]
        for m in going:
            try:
                self.send(m, exit_msg, stall_s=timeout_s)
            except Stalled as e:  # a hung member does not read: it is killed below
                log.warning("%s: %s %s; not waiting for it to exit", self.role, member_where(m), e)
        if going:
            log.debug("%s: waiting up to %.0fs for %d process(es) to exit", self.role, timeout_s, len(going))
        deadline = time.monotonic() + timeout_s
        for m in going:
            m.process.join(max(0.0, deadline - time.monotonic()))
        for m in going:
            if m.process.exitcode is None:
                log.warning("%s: %s did not exit within %.0fs (%s); killing it", self.role, member_where(m),
                            timeout_s, knob)
        return self.discard()

    def discard(self) -> list:
        """Kill everything, close every channel and forget the members (a relaunch starts from
        none); returns the members it held."""
        self.kill_all()
        members, self.members = self.members, []
        for m in members:
            if m.remote:
                shutdown(m.conn)
            m.conn.close()
            if getattr(m, "writer", None) is not None:
                m.writer.stop()
        return members


__all__ = ["LOG_EVERY_S", "SLOW_WAIT_S", "Member", "POLL_S", "ProcessGroup", "Stalled", "log_tail", "member_cause",
           "member_node", "member_where"]
