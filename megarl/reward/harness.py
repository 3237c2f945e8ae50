"""The code sandbox's two programs, stdlib only, each run as ``python -I -S -c <this file> ROLE ...``.

``reply`` runs in the jail (megarl/reward/jail.py) as the slot uid: it executes ``/work/reply.py``
(the reply's program, the only code in its folder), says ``ready`` on the channel, then serves calls:
each request is the arguments of one call of the entry point, each answer its value or exception.

``tester`` (forked per run by ``zygote``) runs outside the jail, as another uid, and holds what the reply must not see: the task's
prompt (the helpers the tests may use, e.g. HumanEval's ``poly``) and its tests. It waits for the
reply's ``ready``, runs ``check(candidate)`` where ``candidate`` (also bound to the entry point's
name) calls across the channel, and writes the verdict to ``VERDICT_FD``, a pipe only it and the
scoring process hold. So (docs/environments.md, "The code sandbox"):

- the test source and the verdict are in no memory, file or descriptor the reply's process has;
- values cross the channel in a tagged binary encoding of exact builtin types only (int, float,
  complex, str, bytes, bool, None, list, tuple, set, frozenset, dict): an object whose ``__eq__``
  is always True cannot cross, and nothing the reply sends is code to the tester;
- anything the reply does to its own process (monkeypatching builtins, redefining ``check``,
  ``sys.exit`` or ``os._exit``, writing garbage on the channel) changes only the values it answers
  with, or ends the run with no pass.

Arguments are copies: a test that relies on the candidate mutating an argument in place fails.
"""

import builtins
import os
import sys

MAX_MESSAGE = 16 << 20  # bytes of one channel message; a larger one is a fail
MAX_DEPTH = 100         # nesting of one encoded value


class ChannelError(BaseException):
    """The channel broke or carried garbage: a fail however the test handles it (a BaseException, so a
    test's ``except Exception`` cannot swallow it, and remembered by the tester besides)."""


def _encode(value, out, depth):
    kind = type(value)
    if depth > MAX_DEPTH:
        raise TypeError("the value is nested too deep")
    if value is None:
        out.append(b"n")
    elif kind is bool:
        out.append(b"T" if value else b"F")
    elif kind is int or kind is float:
        text = (hex(value) if kind is int else value.hex()).encode()
        out += [b"i" if kind is int else b"f", len(text).to_bytes(4, "big"), text]
    elif kind is complex:
        out.append(b"c")
        _encode(value.real, out, depth + 1), _encode(value.imag, out, depth + 1)
    elif kind is str or kind is bytes:
        data = value.encode("utf-8", "surrogatepass") if kind is str else value
        out += [b"s" if kind is str else b"y", len(data).to_bytes(4, "big"), data]
    elif kind is dict:
        out += [b"d", len(value).to_bytes(4, "big")]
        for k, v in value.items():
            _encode(k, out, depth + 1), _encode(v, out, depth + 1)
    elif kind in _SEQ_TAGS:
        out += [_SEQ_TAGS[kind], len(value).to_bytes(4, "big")]
        for v in value:
            _encode(v, out, depth + 1)
    else:
        raise TypeError(f"a {kind.__name__}, not a plain builtin value")


_SEQ_TAGS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"R"}
_SEQ_KINDS = {ord(v): k for k, v in _SEQ_TAGS.items()}


def encode(value):
    """``value`` as bytes (a tag byte, a 4-byte length or count, the payload); TypeError for anything but
    exact builtin types. No json: its import (re, enum) would cost each run's two interpreters ~6 ms."""
    out = []
    _encode(value, out, 0)
    return b"".join(out)


def _decode(data, at, depth):
    if depth > MAX_DEPTH:
        raise ChannelError("a value nested too deep")
    tag = data[at]
    at += 1
    if tag == 110:  # n
        return None, at
    if tag in (84, 70):  # T, F
        return tag == 84, at
    if tag == 99:  # c
        real, at = _decode(data, at, depth + 1)
        imag, at = _decode(data, at, depth + 1)
        if type(real) is not float or type(imag) is not float:
            raise ChannelError("a malformed complex")
        return complex(real, imag), at
    n = int.from_bytes(data[at:at + 4], "big")
    at += 4
    if tag in (105, 102, 115, 121):  # i, f, s, y
        chunk = data[at:at + n]
        if len(chunk) != n:
            raise ChannelError("a truncated value")
        if tag == 105:
            return int(chunk.decode("ascii"), 16), at + n
        if tag == 102:
            return float.fromhex(chunk.decode("ascii")), at + n
        return (chunk.decode("utf-8", "surrogatepass") if tag == 115 else bytes(chunk)), at + n
    if n > len(data) - at:  # every item takes at least a byte: no huge count from a short message
        raise ChannelError("a count larger than the message")
    if tag == 100:  # d
        out = {}
        for _ in range(n):
            k, at = _decode(data, at, depth + 1)
            out[k], at = _decode(data, at, depth + 1)
        return out, at
    kind = _SEQ_KINDS[tag]
    items = []
    for _ in range(n):
        v, at = _decode(data, at, depth + 1)
        items.append(v)
    return kind(items), at


def decode(data):
    """The value :func:`encode` made of ``data`` (all of it); ChannelError on anything else."""
    try:
        value, end = _decode(data, 0, 0)
    except ChannelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed message (bad tag, unhashable key, bad hex)
        raise ChannelError(f"a malformed value on the channel ({type(exc).__name__})") from None
    if end != len(data):
        raise ChannelError("trailing bytes on the channel")
    return value


def send(fd, message):
    data = encode(message)
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise ChannelError("the reply's process ended (the channel closed)")
        buf += chunk
    return buf


def receive(fd):
    n = int.from_bytes(_read_exact(fd, 4), "big")
    if n > MAX_MESSAGE:
        raise ChannelError(f"a channel message of {n} bytes (more than {MAX_MESSAGE})")
    return decode(_read_exact(fd, n))


def reply_main(entry, req_fd, resp_fd):
    """In the jail: run the reply's program, then answer calls of ``entry`` until the channel closes."""
    with open("reply.py", encoding="utf-8") as fh:
        program = fh.read()
    ns = {"__name__": "__reply__", "__builtins__": builtins}
    try:
        exec(compile(program, "reply.py", "exec"), ns)
    except BaseException as e:  # noqa: B036 - SystemExit (sys.exit before the asserts) is a fail too
        send(resp_fd, ["fail", f"the reply's code raised {type(e).__name__}: {e}"[:300]])
        return
    fn = ns.get(entry)
    if not callable(fn):
        send(resp_fd, ["fail", f"the reply defines no function {entry!r}"])
        return
    send(resp_fd, ["ready"])
    while True:
        try:
            args, kwargs = receive(req_fd)
        except ChannelError:
            return
        try:
            out = ["ok", fn(*args, **kwargs)]
        except BaseException as e:  # noqa: B036 - reported to the test as that exception
            out = ["raise", type(e).__name__, str(e)[:300]]
        try:
            send(resp_fd, out)
        except TypeError as e:  # not a plain value: the test sees the TypeError
            send(resp_fd, ["raise", "TypeError", f"the candidate returned {e}"])


# Exceptions that end an iteration instead of failing it: raised inside a test's map() or generator
# (``all(map(lambda c: candidate(*c) == want, cases))``) they would end the loop early and pass it,
# so the test sees them as RuntimeError, as PEP 479 does for a generator.
_ENDS_ITERATION = (StopIteration, StopAsyncIteration)


def _raised(name, text):
    """The exception to raise in the test for the reply's ``name``: that builtin type, else (and for
    StopIteration / StopAsyncIteration) RuntimeError."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, _ENDS_ITERATION):
        return kind(text)
    return RuntimeError(f"{name}: {text}")


def tester_main(job_fd, req_fd, resp_fd, verdict_fd):
    """Outside the jail: read the job from ``job_fd``, run the task's tests against the channel's
    candidate, write ``P`` (all passed) or ``F<reason>`` to ``verdict_fd``."""
    with os.fdopen(job_fd, "rb") as fh:
        job = decode(fh.read())
    entry = job["entry_point"]

    def verdict(data):
        os.write(verdict_fd, data[:400])

    broken = []

    def candidate(*args, **kwargs):
        if broken:
            raise broken[0]
        try:
            send(req_fd, [list(args), kwargs])
            answer = receive(resp_fd)
            if answer[0] == "ok":
                return answer[1]
            if answer[0] != "raise":
                raise ChannelError("an unexpected message on the channel")
        except (ChannelError, OSError, TypeError, IndexError, KeyError) as e:  # a protocol the reply broke
            broken.append(e if isinstance(e, ChannelError) else ChannelError(f"the channel failed ({e})"))
            raise broken[0] from None
        raise _raised(str(answer[1]), str(answer[2]))

    ns = {"__name__": "__tests__"}
    prompt = job.get("prompt") or ""
    for text in (prompt, prompt + "\n    pass\n"):  # a prompt that ends at a def's docstring or colon
        try:
            exec(compile(text, "prompt.py", "exec"), ns)
            break
        except BaseException:  # noqa: B036, S110 - the tests then run without the prompt's helpers
            ns = {"__name__": "__tests__"}
    try:
        hello = receive(resp_fd)
    except ChannelError as e:
        verdict(f"F{e} before it was ready".encode())
        return
    if hello[0] != "ready":
        verdict(b"F" + str(hello[1] if hello[0] == "fail" and len(hello) > 1 else hello).encode("utf-8", "replace"))
        return
    ns[entry] = candidate
    try:
        exec(compile(job["test"], "test.py", "exec"), ns)
        ns["check"](candidate)
        if broken:
            raise broken[0]
    except ChannelError as e:
        verdict(f"F{e}".encode())
        return
    except BaseException as e:  # noqa: B036
        verdict(f"Fa test failed: {type(e).__name__}: {e}"[:300].encode("utf-8", "replace"))
        return
    verdict(b"P")


def zygote_main(sock_fd):
    """The scoring process's tester server (megarl/reward/testers.py), already the tester uid: for each
    run it receives (job, req, resp, verdict, stderr) descriptors and a CPU limit, forks a tester for
    them, and answers with a pidfd of it (the scoring process kills through it, race-free). Forking this
    small, single-threaded process costs ~1 ms where a fresh interpreter costs ~10 ms of CPU per run."""
    import resource
    import signal
    import socket

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # testers are reaped by the kernel
    sock = socket.socket(fileno=sock_fd)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 5)
        except OSError:
            return
        if not msg:
            return  # the scoring process is gone
        if len(fds) != 5:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                cpu_s, as_bytes = int(msg[:8]), int(msg[8:24])
                resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
                resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
                os.dup2(fds[4], 2)
                tester_main(*fds[:4])
            finally:
                os._exit(0)
        pidfd = os.pidfd_open(pid)
        for fd in fds:
            os.close(fd)
        try:
            socket.send_fds(sock, [b"ok"], [pidfd])
        except OSError:
            return
        finally:
            os.close(pidfd)


if __name__ == "__main__":
    if sys.argv[1] == "reply":
        reply_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "zygote":
        zygote_main(int(sys.argv[2]))
    os._exit(0)
