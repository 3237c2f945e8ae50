"""The code sandbox's harness: runs INSIDE the sandboxed child (megarl/reward/sandbox.py), stdlib only.

Written into the child's private temp dir and run as ``python -I -S harness.py REPORT_FD``. It runs
the reply's program, then the task's tests against it, and reports on the pipe ``REPORT_FD``. How a
pass is decided, so that a reply cannot fake one (docs/environments.md, "The code sandbox"):

1. The reply's program runs first, at top level, in its own namespace. Anything it raises
   (``SystemExit`` from ``sys.exit(0)`` included) is a fail; ``os._exit`` ends the process with no
   pass report, which is a fail.
2. Only then does the harness write ``R`` and read the run's nonce from stdin. The parent sends the
   nonce only after it has read ``R``, so a reply's top-level code cannot know it.
3. The tests run in a namespace whose builtins are a copy taken before the reply ran, with every
   module the reply imported dropped from ``sys.modules`` (the tests import their own); the reply's
   ``check`` or helpers are replaced by the test file's own definitions, which run last.
4. The candidate is called through a guard: its return value must be made of exact builtin types
   (int, float, str, list, dict, ...), so an object whose ``__eq__`` always returns True fails.
5. After the tests, every callable of every module loaded before the reply ran, and every builtin,
   must be the object it was (a reply that monkeypatched a helper the asserts use fails).
6. The pass report is ``P`` + the nonce, and the parent accepts exactly ``R`` + ``P`` + nonce: any
   other byte on the pipe (a reply writing to it) spoils the run.

What stays possible: a reply written against this protocol (finding the pipe in /proc/self/fd,
reading the nonce from stdin after forging ``R``). The sandbox's limits still hold for it.
"""

import builtins
import os
import sys

_write, _read, _close, _exit = os.write, os.read, os.close, os._exit
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_CONTAINERS = (list, tuple, set, frozenset, dict)


def _plain(value, depth=0):
    """True when ``value`` is made only of exact builtin types (no subclass can override ``__eq__``)."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind not in _CONTAINERS or depth > 50:
        return False
    items = value.items() if kind is dict else ((v, None) for v in value)
    return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in items)


def _guard(fn):
    def candidate(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not _plain(out):
            raise TypeError(f"the candidate returned a {type(out).__name__}, not a plain builtin value")
        return out
    return candidate


def _snapshot():
    mods = {name: {k: id(v) for k, v in vars(m).items() if callable(v)}
            for name, m in list(sys.modules.items()) if m is not None and name not in ("__main__", "sys")}
    return mods, {k: id(v) for k, v in vars(builtins).items()}


def _tampered(mods, builts):
    for k, ident in builts.items():
        if id(vars(builtins).get(k)) != ident:
            return f"builtins.{k}"
    for name, attrs in mods.items():
        m = sys.modules.get(name)
        if m is None:
            continue
        now = vars(m)
        for k, ident in attrs.items():
            if k in now and id(now[k]) != ident:
                return f"{name}.{k}"
    return ""


def main(report_fd):
    def fail(why):
        _write(report_fd, b"F" + why.encode("utf-8", "replace")[:400])

    with open("reply.py", encoding="utf-8") as fh:
        program = fh.read()
    with open("test.py", encoding="utf-8") as fh:
        tests = fh.read()
    with open("entry_point", encoding="utf-8") as fh:
        entry = fh.read().strip()
    clean = dict(vars(builtins))
    loaded = set(sys.modules)
    mods, builts = _snapshot()
    ns = {"__name__": "__reply__", "__builtins__": builtins}
    try:
        exec(compile(program, "reply.py", "exec"), ns)
    except BaseException as e:  # noqa: B036 - SystemExit (sys.exit before the asserts) is a fail too
        fail(f"the reply's code raised {type(e).__name__}: {e}"[:300])
        return
    _write(report_fd, b"R")
    nonce = _read(0, 128).strip()
    _close(0)
    fn = ns.get(entry)
    if not callable(fn):
        fail(f"the reply defines no function {entry!r}")
        return
    for name in set(sys.modules) - loaded:
        sys.modules.pop(name, None)
    test_ns = dict(ns)
    test_ns["__builtins__"] = dict(clean)
    test_ns["__name__"] = "__tests__"
    try:
        exec(compile(tests, "test.py", "exec"), test_ns)
        test_ns["check"](_guard(fn))
    except BaseException as e:  # noqa: B036
        fail(f"a test failed: {type(e).__name__}: {e}"[:300])
        return
    changed = _tampered(mods, builts)
    if changed:
        fail(f"the reply replaced {changed}")
        return
    _write(report_fd, b"P" + nonce)


if __name__ == "__main__":
    main(int(sys.argv[1]))
    _exit(0)
