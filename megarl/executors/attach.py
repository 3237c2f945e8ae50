"""Attach mode of the trainer executor: ranks started elsewhere (srun on other nodes) connect to it.

The executor listens on the job's controller port (``MEGARL_CONTROLLER_PORT``, from
``megarl.cluster.slurm``) with the job's authkey (``MEGARL_AUTHKEY``, chosen by the launcher and
passed to every task by srun), each rank connects (:func:`connect`, retrying while the controller
starts), authenticates (``multiprocessing.connection``'s HMAC challenge, both ways) and says
``("hello", {"rank", "host", "pid", "job"})``. From then on the connection carries exactly the
protocol of the local pipe (``megarl.trainer.worker``). A rank's liveness is its connection (EOF)
and its heartbeats; :class:`RemoteProcess` gives the executor's supervision the ``pid`` /
``exitcode`` / ``join`` / ``is_alive`` of a local process. Ranks exit when the executor's end of
the connection closes (no PDEATHSIG across nodes).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

log = logging.getLogger(__name__)

_LOG_EVERY_S = 30.0
_HANDSHAKE_S = 30.0  # an accepted socket must authenticate and say hello within this


class AttachError(RuntimeError):
    """Ranks did not attach (missing, duplicate, or a bad environment); the message says which."""


def channel_port_var(role: str) -> str:
    """The job variable holding the port ``role``'s ranks attach to: the trainer's is the controller
    port, the generator's its own; a rank pool of another role (teacher, critic) ``MEGARL_<ROLE>_PORT``."""
    return {"trainer": "MEGARL_CONTROLLER_PORT", "generator": "MEGARL_GENERATOR_PORT"}.get(
        role, f"MEGARL_{role.upper()}_PORT")


def rendezvous_vars(role: str) -> tuple[str, str]:
    """(address, port) variables of ``role``'s torch.distributed rendezvous: the trainer's is the job's
    MASTER; a rank pool of another role has its own (its ranks form a process group of their own)."""
    return ("MEGARL_MASTER_ADDR", "MEGARL_MASTER_PORT") if role == "trainer" else \
        (f"MEGARL_{role.upper()}_MASTER_ADDR", f"MEGARL_{role.upper()}_MASTER_PORT")


@dataclass(frozen=True)
class AttachSpec:
    port: int
    authkey: bytes
    job_id: str = ""
    bind: str = ""  # all interfaces

    @classmethod
    def from_env(cls, env=os.environ, port_var: str = "MEGARL_CONTROLLER_PORT") -> "AttachSpec":
        """The trainer's listener (``MEGARL_CONTROLLER_PORT``) or another role's (``port_var``:
        :func:`channel_port_var`; the generator's replicas attach at ``MEGARL_GENERATOR_PORT``)."""
        port, key = env.get(port_var, ""), env.get("MEGARL_AUTHKEY", "")
        if not port.isdigit() or not key:
            raise AttachError(f"cluster.launcher=slurm: {port_var} / MEGARL_AUTHKEY are not set; start the "
                              "job with `megarl launch slurm` (or `megarl launch local`), or set cluster.launcher=local")
        return cls(int(port), key.encode(), env.get("MEGARL_JOB_ID", ""))


class RemoteProcess:
    """A rank process on another host (or started by another launcher), seen through its
    connection. ``exitcode``: None while connected; after EOF 0 if it had acknowledged ``exit``,
    else 1 (unknown: its node's srun reports the real one)."""

    def __init__(self, pid: int, host: str):
        self.pid, self.host = int(pid), str(host)
        self._gone = threading.Event()
        self._clean = False

    def mark_gone(self, clean: bool) -> None:
        self._clean = clean
        self._gone.set()

    @property
    def exitcode(self) -> int | None:
        return None if not self._gone.is_set() else (0 if self._clean else 1)

    def join(self, timeout: float | None = None) -> None:
        self._gone.wait(timeout)

    def is_alive(self) -> bool:
        return not self._gone.is_set()


def shutdown(conn: Connection) -> None:
    """Close a socket connection so that a thread blocked reading it wakes (EOF) and the peer
    sees EOF at once (``close`` alone does neither while another thread reads)."""
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.close()
    except (OSError, ValueError):
        pass


def accept_ranks(spec: AttachSpec, world: int, timeout_s: float, role: str = "trainer", unit: str = "rank",
                 timeout_knob: str = "trainer.start_timeout_s") -> list[tuple[Connection, dict]]:
    """Wait up to ``timeout_s`` until ``role``'s ranks (or replicas: ``unit``) 0..world-1 have each
    connected and said hello; their (connection, hello) in rank order. Raises
    :class:`AttachError` naming the missing ones (every accepted connection closed)."""
    got: dict[int, tuple[Connection, dict]] = {}
    srv = socket.create_server((spec.bind, spec.port), backlog=max(world, 16))
    srv.settimeout(0.5)
    start = time.monotonic()
    deadline, last_log = start + timeout_s, start
    log.info("%s: waiting up to %.0fs for %d external %s(s) to attach on port %d", role, timeout_s, world, unit,
             spec.port)
    try:
        while len(got) < world:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world)) - set(got))
                raise AttachError(f"{role}: {unit}(s) {missing} of {world} did not attach within {timeout_s:.0f}s "
                                  f"({timeout_knob}) on port {spec.port}; attached: "
                                  f"{[_where(h) for _, h in sorted(got.values(), key=lambda x: x[1]['rank'])]}. "
                                  f"Check the {role} srun step's output")
            if now - last_log > _LOG_EVERY_S:
                log.info("%s: still waiting for %s(s) %s to attach (%.0fs left)", role, unit,
                         sorted(set(range(world)) - set(got)), deadline - now)
                last_log = now
            try:
                sock, peer = srv.accept()
            except (socket.timeout, BlockingIOError):
                continue
            # One peer that connects and says nothing must not hold the wait past its deadline
            conn, hello = _handshake(sock, peer, spec, role, min(_HANDSHAKE_S, deadline - time.monotonic()))
            if conn is None:
                continue
            r = hello.get("rank")
            if not isinstance(r, int) or not 0 <= r < world or r in got:
                why = "twice" if r in got else f"outside 0..{world - 1}"
                conn.close()
                raise AttachError(f"{role}: {_where(hello)} attached as {unit} {r} ({why}); the {role} pool's tasks "
                                  f"and its size {world} disagree")
            log.info("%s: %s %d attached from %s", role, unit, r, _where(hello))
            got[r] = (conn, hello)
    except BaseException:
        for conn, _ in got.values():
            shutdown(conn)
            conn.close()
        raise
    finally:
        srv.close()
    return [got[r] for r in range(world)]


def _handshake(sock: socket.socket, peer, spec: AttachSpec, role: str = "trainer",
               bound_s: float = _HANDSHAKE_S) -> tuple[Connection | None, dict]:
    """Authenticate an accepted socket (the challenge both ways) and read its hello, all within
    ``bound_s``; (connection, hello), or (None, {}) for a peer refused: a foreign key, a stray client,
    or one that stays silent (a probe, a rank whose node hung right after connecting)."""
    give_up = time.monotonic() + bound_s
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        _bound_io(conn, bound_s)  # the challenge's reads take no timeout of their own
        deliver_challenge(conn, spec.authkey)
        answer_challenge(conn, spec.authkey)
        if not conn.poll(max(0.0, give_up - time.monotonic())):
            raise TimeoutError("no hello")
        _bound_io(conn, give_up - time.monotonic())
        kind, hello = pickle.loads(conn.recv_bytes())
        if kind != "hello" or not isinstance(hello, dict):
            raise ValueError(f"expected hello, got {kind!r}")
        if spec.job_id and str(hello.get("job", "")) != spec.job_id:
            raise ValueError(f"it belongs to job {hello.get('job')!r}, not {spec.job_id}")
        _bound_io(conn, None)  # from here the protocol's reads wait as long as the rank lives
    except Exception as e:  # noqa: BLE001 - a stray, foreign or silent client is refused, the wait goes on
        why = f"it did not authenticate and say hello within {bound_s:.1f}s" if _timed_out(e) else e
        log.warning("%s: refused a connection from %s: %s", role, peer, why)
        conn.close()
        return None, {}
    return conn, hello


def _bound_io(sock: socket.socket | Connection, seconds: float | None) -> None:
    """Bound each blocking read and write of ``sock`` by ``seconds`` (None: no bound) with SO_RCVTIMEO /
    SO_SNDTIMEO, the one bound that a :class:`Connection`'s raw ``os.read`` / ``os.write`` obey: past
    it they raise BlockingIOError (EAGAIN)."""
    # A timeval of 0 means "no bound": a bound that has run out becomes the smallest one
    us = 0 if seconds is None else max(1, int(seconds * 1e6))
    timeval = struct.pack("ll", us // 1_000_000, us % 1_000_000)
    s = socket.socket(fileno=os.dup(sock.fileno()))  # the options are the socket's, shared by every fd of it
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    finally:
        s.close()


def _timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a bound of :func:`_bound_io` (EAGAIN from a raw read or write) or a poll's."""
    return isinstance(e, (TimeoutError, BlockingIOError))


def _dial(host: str, port: int, authkey: bytes, timeout_s: float) -> Connection:
    """``multiprocessing.connection.Client((host, port), authkey)`` with every step bounded by
    ``timeout_s``: the TCP connect, and the challenge both ways (in Client's order), whose reads take no
    timeout of their own, so a listener that accepts and never speaks would hold the rank forever."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setblocking(True)  # Connection reads the raw fd: the bound is _bound_io's, not the socket's timeout
        _bound_io(sock, timeout_s)
        conn = Connection(sock.detach())
    finally:
        sock.close()  # a no-op once detached
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException as e:
        conn.close()
        if _timed_out(e):
            raise TimeoutError(f"{host}:{port} accepted the connection but did not complete the authentication "
                               f"handshake within {timeout_s:.1f}s") from e
        raise
    _bound_io(conn, None)  # from here the protocol's reads wait as long as the controller lives
    return conn


def connect(host: str, port: int, authkey: bytes, timeout_s: float,
            timeout_knob: str = "trainer.start_timeout_s") -> Connection:
    """A rank's connection to the executor: retried (the controller may still be starting) for up
    to ``timeout_s``, each try (connect and authentication) bounded by the time left; raises
    AttachError naming the address and the knob. A wrong key raises AuthenticationError at once."""
    start = time.monotonic()
    deadline, last_log, err = start + timeout_s, start, None
    log.info("waiting up to %.0fs to reach the controller at %s:%d", timeout_s, host, port)
    while (left := deadline - time.monotonic()) > 0:
        try:
            return _dial(host, port, authkey, left)
        except (OSError, EOFError) as e:  # refused, reset, unresolved, timed out; EOF: closed mid-handshake
            err = e
        if time.monotonic() - last_log > _LOG_EVERY_S:
            log.info("still waiting for the controller at %s:%d (%s)", host, port, err)
            last_log = time.monotonic()
        time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
    raise AttachError(f"could not reach the controller at {host}:{port} within {timeout_s:.0f}s "
                      f"({timeout_knob}): {err}")


def join_controller(who: str, index: int, controller: tuple[str, int], authkey: bytes, job_id: str,
                    timeout_s: float, timeout_knob: str) -> tuple[Connection, dict]:
    """The far end of :func:`accept_ranks` (a trainer rank or a generator replica started by a
    launcher): SIGTERM deferred to the controller, connect, say hello as ``index``, and wait for the
    controller's start arguments; (connection, the ``init`` dict)."""
    from megarl.utils.procs import defer_sigterm_to_controller

    defer_sigterm_to_controller(f"{who} {index}")  # a preemption checkpoints through the controller
    conn = connect(controller[0], controller[1], authkey, timeout_s, timeout_knob=timeout_knob)
    conn.send(("hello", {"rank": index, "host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME", ""),
                         "pid": os.getpid(), "job": job_id}))
    log.info("%s %d: attached to the controller at %s:%d; waiting up to %.0fs for its start arguments", who, index,
             controller[0], controller[1], timeout_s)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{who} {index}: the controller sent no start arguments within {timeout_s:.0f}s "
                           f"({timeout_knob})")
    kind, init = conn.recv()
    if kind != "init":
        raise RuntimeError(f"{who} {index}: expected the controller's 'init', got {kind!r}")
    return conn, init


def _where(hello: dict) -> str:
    """``pid N on node`` (the Slurm node name when the task has one; several nodes may share a host)."""
    return f"pid {hello.get('pid')} on {hello.get('node') or hello.get('host')}"


__all__ = ["AttachError", "AttachSpec", "RemoteProcess", "accept_ranks", "channel_port_var", "connect", "join_controller",
           "rendezvous_vars", "shutdown"]
