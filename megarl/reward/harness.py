"""The code sandbox's two programs, stdlib only, each run as ``python -I -S -c <this file> ROLE ...``.

``reply`` runs in the jail (megarl/reward/jail.py) as the slot uid: it executes ``/work/reply.py``
(the reply's program, the only code in its folder), says ``ready`` on the channel, then serves calls:
each request is the arguments of one call of the entry point, each answer its value or exception.

``tester`` runs outside the jail, as another uid, and holds what the reply must not see: the task's
prompt (the helpers the tests may use, e.g. HumanEval's ``poly``) and its tests. It waits for the
reply's ``ready``, runs ``check(candidate)`` where ``candidate`` (also bound to the entry point's
name) calls across the channel, and writes the verdict to ``VERDICT_FD``, a pipe only it and the
scoring process hold. So (docs/environments.md, "The code sandbox"):

- the test source and the verdict are in no memory, file or descriptor the reply's process has;
- values cross the channel in a tagged JSON encoding of exact builtin types only (int, float,
  complex, str, bytes, bool, None, list, tuple, set, frozenset, dict): an object whose ``__eq__``
  is always True cannot cross, and nothing the reply sends is code to the tester;
- anything the reply does to its own process (monkeypatching builtins, redefining ``check``,
  ``sys.exit`` or ``os._exit``, writing garbage on the channel) changes only the values it answers
  with, or ends the run with no pass.

Arguments are copies: a test that relies on the candidate mutating an argument in place fails.
"""

import builtins
import json
import os
import sys

MAX_MESSAGE = 16 << 20  # bytes of one channel message; a larger one is a fail
MAX_DEPTH = 100         # nesting of one encoded value


class ChannelError(BaseException):
    """The channel broke or carried garbage: a fail however the test handles it (a BaseException, so a
    test's ``except Exception`` cannot swallow it, and remembered by the tester besides)."""


def encode(value, depth=0):
    """``value`` as JSON-able tagged lists; TypeError for anything but exact builtin types."""
    kind = type(value)
    if depth > MAX_DEPTH:
        raise TypeError("the value is nested too deep")
    if value is None or kind is bool:
        return ["n"] if value is None else ["b", value]
    if kind is int:
        return ["i", hex(value)]
    if kind is float:
        return ["f", value.hex()]
    if kind is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if kind is str:
        return ["s", value]
    if kind is bytes:
        return ["y", value.hex()]
    if kind is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}.get(kind)
    if tag is None:
        raise TypeError(f"a {kind.__name__}, not a plain builtin value")
    return [tag, [encode(v, depth + 1) for v in value]]


def decode(item, depth=0):
    """The value :func:`encode` made; ChannelError on anything else."""
    try:
        tag = item[0]
        if depth > MAX_DEPTH:
            raise ChannelError("nested too deep")
        if tag == "n" and len(item) == 1:
            return None
        if tag == "b" and type(item[1]) is bool:
            return item[1]
        if tag == "i":
            return int(item[1], 16)
        if tag == "f":
            return float.fromhex(item[1])
        if tag == "c":
            return complex(float.fromhex(item[1]), float.fromhex(item[2]))
        if tag == "s" and type(item[1]) is str:
            return item[1]
        if tag == "y":
            return bytes.fromhex(item[1])
        if tag == "d":
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in item[1]}
        kind = {"l": list, "t": tuple, "S": set, "F": frozenset}[tag]
        return kind(decode(v, depth + 1) for v in item[1])
    except ChannelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed message
        raise ChannelError(f"a malformed value on the channel ({type(exc).__name__})") from None


def send(fd, message):
    data = json.dumps(message).encode()
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
    try:
        return json.loads(_read_exact(fd, n))
    except (ValueError, RecursionError):
        raise ChannelError("a malformed message on the channel") from None


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
            args, kwargs = decode(args), decode(kwargs)
        except ChannelError:
            return
        try:
            out = ["ok", encode(fn(*args, **kwargs))]
        except BaseException as e:  # noqa: B036 - reported to the test as that exception
            out = ["raise", type(e).__name__, str(e)[:300]]
        send(resp_fd, out)


def _raised(name, text):
    """The exception to raise in the test for the reply's ``name``: that builtin type, else RuntimeError."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(text)
    return RuntimeError(f"{name}: {text}")


def tester_main(req_fd, resp_fd, verdict_fd):
    """Outside the jail: read the job from stdin, run the task's tests against the channel's candidate,
    write ``P`` (all passed) or ``F<reason>`` to ``verdict_fd``."""
    job = json.loads(sys.stdin.read())
    entry = job["entry_point"]

    def verdict(data):
        os.write(verdict_fd, data[:400])

    broken = []

    def candidate(*args, **kwargs):
        if broken:
            raise broken[0]
        try:
            send(req_fd, [encode(list(args)), encode(kwargs)])
            answer = receive(resp_fd)
            if answer[0] == "ok":
                return decode(answer[1])
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


if __name__ == "__main__":
    if sys.argv[1] == "reply":
        reply_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        tester_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    os._exit(0)
