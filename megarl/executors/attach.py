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
            conn, hello = _handshake(sock, peer, spec, role)
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


def _handshake(sock: socket.socket, peer, spec: AttachSpec, role: str = "trainer") -> tuple[Connection | None, dict]:
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, spec.authkey)
        answer_challenge(conn, spec.authkey)
        if not conn.poll(_HANDSHAKE_S):
            raise TimeoutError("no hello")
        kind, hello = pickle.loads(conn.recv_bytes())
        if kind != "hello" or not isinstance(hello, dict):
            raise ValueError(f"expected hello, got {kind!r}")
        if spec.job_id and str(hello.get("job", "")) != spec.job_id:
            raise ValueError(f"it belongs to job {hello.get('job')!r}, not {spec.job_id}")
    except Exception as e:  # noqa: BLE001 - a stray or foreign client is refused, the wait goes on
        log.warning("%s: refused a connection from %s: %s", role, peer, e)
        conn.close()
        return None, {}
    return conn, hello


def connect(host: str, port: int, authkey: bytes, timeout_s: float,
            timeout_knob: str = "trainer.start_timeout_s") -> Connection:
    """A rank's connection to the executor: retried (the controller may still be starting) for up
    to ``timeout_s``; raises AttachError naming the address and the knob."""
    from multiprocessing.connection import Client

    start = time.monotonic()
    deadline, last_log, err = start + timeout_s, start, None
    log.info("waiting up to %.0fs to reach the controller at %s:%d", timeout_s, host, port)
    while time.monotonic() < deadline:
        try:
            return Client((host, port), authkey=authkey)
        except (ConnectionRefusedError, ConnectionResetError, socket.gaierror, TimeoutError, OSError) as e:
            err = e
        if time.monotonic() - last_log > _LOG_EVERY_S:
            log.info("still waiting for the controller at %s:%d (%s)", host, port, err)
            last_log = time.monotonic()
        time.sleep(0.5)
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
