"""The code sandbox's tester processes, forked per run by one server (a zygote) per scoring process.

The zygote (megarl/reward/harness.py ``zygote``) is ``python -I -S`` started once as the tester uid
(``nobody``), dying with its scoring process; :func:`start` asks it for a tester of one run, giving it
the run's descriptors over a unix socket, and gets a pidfd back to kill the tester through. The
tester never holds anything of another run: it is a fresh fork of the zygote, which runs no test.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
from typing import Optional

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


class TesterError(RuntimeError):
    pass


class _Zygote:
    def __init__(self, python: str, source: str, uid: int):
        self.owner = os.getpid()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

        def drop() -> None:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with its scoring process
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

        self.proc = subprocess.Popen([python, "-I", "-S", "-c", source, "zygote", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, cwd="/",
                                     env={"LANG": "C.UTF-8"}, preexec_fn=drop)
        theirs.close()

    def fork(self, fds: tuple, cpu_s: int, as_bytes: int, timeout_s: float) -> int:
        """A pidfd of a new tester holding ``fds`` (job, req, resp, verdict, stderr)."""
        self.sock.settimeout(timeout_s)
        socket.send_fds(self.sock, [b"%08d%016d" % (cpu_s, as_bytes)], list(fds))
        _, got, _, _ = socket.recv_fds(self.sock, 16, 1)
        if len(got) != 1:
            raise TesterError("the tester server answered without a process")
        return got[0]

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait(timeout=5)


_lock = threading.Lock()  # one request at a time on the socket
_zygote: Optional[_Zygote] = None


def start(python: str, source: str, uid: int, fds: tuple, cpu_s: int, as_bytes: int) -> int:
    """A pidfd of a tester for one run; the zygote is (re)started when missing, dead or inherited
    across a fork. :class:`TesterError` when it cannot give one twice in a row."""
    global _zygote
    with _lock:
        for attempt in range(2):
            if _zygote is None or _zygote.owner != os.getpid() or _zygote.proc.poll() is not None:
                if _zygote is not None and _zygote.owner == os.getpid():
                    _zygote.close()
                _zygote = _Zygote(python, source, uid)
            try:
                return _zygote.fork(fds, cpu_s, as_bytes, timeout_s=30)
            except (OSError, TesterError) as exc:
                _zygote.close()
                _zygote = None
                if attempt:
                    raise TesterError(f"the code sandbox's tester server failed twice: {exc}") from None
    raise AssertionError("unreachable")


def kill(pidfd: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)
