"""A real multi-node Slurm cluster on this one host, for the suite and for trying the sbatch scripts.

Debian's ``slurm-wlm`` (22.05) and ``munge``: one ``munged``, one ``slurmctld`` and one ``slurmd -N nI``
per node. Each node has its own address (``nI`` -> ``127.0.0.(10+I)`` in /etc/hosts) and port, its
own spool and log, and two "GPUs" that are plain files (``GresTypes=gpu``), so ``--gpus-per-node=2``
is accepted and a job sees ``SLURM_GPUS_ON_NODE=2`` with ``CUDA_VISIBLE_DEVICES`` unset. Jobs run as
root with ``proctrack/linuxproc`` (no cgroups in a container). Everything the cluster writes lives
under one folder; :meth:`SlurmCluster.down` stops every daemon and job.

    python tests/harness/slurm_cluster.py up [--nodes 4] [--dir /tmp/megarl-slurm]   # prints: export SLURM_CONF=...
    python tests/harness/slurm_cluster.py down [--dir /tmp/megarl-slurm]

Installing: when ``slurmctld`` is missing and this is root with apt, :func:`ensure_installed` runs
``apt-get install -y slurm-wlm munge`` (about a minute); otherwise :class:`SlurmUnavailable` says why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.harness.procs import alive

ADDR_BASE = 10           # node nI lives at 127.0.0.(ADDR_BASE + I)
HOSTS_MARK = "# megarl-slurm-test"
START_TIMEOUT_S = 60.0   # daemons up and every node idle (seen: ~5 s)
# Preemption: a job in partition ``urgent`` (PriorityTier 2) preempts jobs of the default ``debug``
# (PriorityTier 1) it needs nodes of; PreemptMode=REQUEUE with this GraceTime: the preempted job gets
# SIGTERM at once and is requeued (SIGKILL after KillWait) when the grace ends. 30 s = KillWait, the
# bound the scontrol-requeue test already holds the checkpoint to.
PREEMPT_GRACE_S = 30
URGENT_PARTITION = "urgent"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (no binaries and no way to install them, or not root)."""


def _run(cmd: list[str], timeout: float = 60.0, env: dict | None = None, check: bool = True) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def ensure_installed(log=print) -> None:
    """slurm-wlm + munge present, installing them with apt when missing (root only)."""
    if shutil.which("slurmctld") and shutil.which("munged") and shutil.which("sbatch"):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurm-wlm is not installed and this is not root (cannot apt-get install it)")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm is not installed and there is no apt-get to install it")
    log("[slurm] installing slurm-wlm and munge with apt-get (once; about a minute)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    out = subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], capture_output=True, text=True,
                         env=env, timeout=900)
    if out.returncode:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        out = subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], capture_output=True,
                             text=True, env=env, timeout=900)
    if out.returncode or not shutil.which("slurmctld"):
        raise SlurmUnavailable(f"apt-get install slurm-wlm munge failed: {out.stderr.strip()[-500:]}")


def _free_port_block(count: int) -> int:
    import random

    for _ in range(100):
        base = random.randrange(40000, 60000 - count)
        socks = []
        try:
            for i in range(count):
                socks.append(socket.create_server(("", base + i)))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports in 40000-60000")


class SlurmCluster:
    """munged + slurmctld + ``nodes`` slurmd on this host. ``env()`` is what a client needs
    (``SLURM_CONF``); ``sbatch``/``wait``/``sacct`` wrap the commands tests use."""

    def __init__(self, root: str | os.PathLike, nodes: int = 4, cpus_per_node: int = 8, gpus_per_node: int = 2):
        self.root = Path(root).resolve()
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus, self.gpus = cpus_per_node, gpus_per_node
        self.conf = self.root / "etc" / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []

    # -------------------------------------------------------------------------------- lifecycle
    def up(self) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster needs root (slurmd, munged and /etc/hosts)")
        ensure_installed()
        self.down(quiet=True)  # a cluster left by a killed run in the same folder
        for sub in ("state", "log"):  # a fresh cluster: no job or node state of an earlier one
            shutil.rmtree(self.root / sub, ignore_errors=True)
        for sub in ("etc", "state", "log", "gres"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._hosts()
        self._write_conf()
        self._start_munge()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        self._wait_idle()
        (self.root / "cluster.json").write_text(json.dumps({"pids": [p.pid for p in self.procs],
                                                            "conf": str(self.conf)}))
        return self

    def down(self, quiet: bool = False) -> None:
        """Cancel every job, stop the daemons (ours, or those a killed run left in this folder)."""
        pids = [p.pid for p in self.procs]
        state = self.root / "cluster.json"
        if state.is_file():
            pids += json.loads(state.read_text()).get("pids", [])
        if self.conf.is_file() and shutil.which("scancel") and any(alive(p) for p in pids):
            try:  # jobs first, while slurmctld still answers
                subprocess.run(["scancel", "--full", "-u", "root"], env=self.env(), capture_output=True, timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for pid in dict.fromkeys(pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for pid in dict.fromkeys(pids):
            while time.monotonic() < deadline and alive(pid):
                time.sleep(0.1)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        # daemons a failed start did not record, then job steps (they outlive slurmd under proctrack/linuxproc)
        subprocess.run(["pkill", "-KILL", "-f", f"slurm(ctld|d) .*-f {self.conf}"], capture_output=True)
        subprocess.run(["pkill", "-KILL", "-f", f"slurmstepd.*{self.root}"], capture_output=True)
        # a slurmstepd's command line is "slurmstepd: [JOB.STEP]" (no folder in it): find the steps and
        # their tasks by the SLURM_CONF they inherited from this cluster's slurmd or sbatch
        mine = {os.getpid(), os.getppid()}
        for pid, env in process_environs():
            if env.get("SLURM_CONF") == str(self.conf) and pid not in mine:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        state.unlink(missing_ok=True)
        munge_pid = self.root / "state" / "munged.pid"
        if munge_pid.is_file():
            try:
                os.kill(int(munge_pid.read_text().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass

    def __enter__(self) -> "SlurmCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ---------------------------------------------------------------------------------- clients
    def env(self, base: dict | None = None) -> dict[str, str]:
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def sbatch(self, args: list[str], cwd: str | os.PathLike, env: dict | None = None) -> int:
        """Submit; returns the job id."""
        out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60,
                             env=self.env(env), cwd=cwd)
        if out.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        out = out.stdout
        return int(out.strip().split(";")[0].split("+")[0])

    def state(self, job: int) -> dict:
        """``{"state", "exit", "restarts"}`` of the job (het jobs: the first component) from scontrol."""
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True,
                             env=self.env(), timeout=30).stdout
        first = out.splitlines()[0] if out.strip() else ""
        fields = dict(kv.split("=", 1) for kv in first.split() if "=" in kv)
        return {"state": fields.get("JobState", "UNKNOWN"), "exit": fields.get("ExitCode", ""),
                "restarts": int(fields.get("Restarts", "0") or 0), "reason": fields.get("Reason", "")}

    def wait(self, job: int, timeout_s: float, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                     "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")) -> dict:
        """Poll until the job reaches one of ``until``; raises TimeoutError with its last state."""
        deadline = time.monotonic() + timeout_s
        st = {}
        while time.monotonic() < deadline:
            st = self.state(job)
            if st["state"] in until:
                return st
            time.sleep(1.0)
        raise TimeoutError(f"job {job} still {st} after {timeout_s:.0f}s")

    def sacct(self, job: int) -> list[dict]:
        """Every record of the job (steps and het components) from the controller's memory."""
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True, text=True,
                             env=self.env(), timeout=30).stdout
        return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.splitlines() if line]

    def slurmd_pid(self, node: str) -> int:
        """The pid of ``node``'s slurmd (started by :meth:`up` in this process)."""
        for p in self.procs:
            if p.args[-4:-2] == ["-N", node]:
                return p.pid
        raise KeyError(f"no slurmd of {node} started by this SlurmCluster")

    def node_processes(self, node: str, job: int) -> list[int]:
        """What "runs on" ``node`` for ``job`` (every node is this host): the job's processes whose
        SLURMD_NODENAME is ``node`` (its tasks and their children), the slurmstepd above each, and
        the node's slurmd."""
        tasks = [pid for pid, env in process_environs() if env.get("SLURM_JOB_ID") == str(job)
                 and env.get("SLURMD_NODENAME") == node]
        steps = set()
        for pid in tasks:
            ppid = _ppid(pid)
            while ppid > 1 and ppid not in tasks:
                if _comm(ppid).startswith("slurmstepd"):
                    steps.add(ppid)
                    break
                ppid = _ppid(ppid)
        return [self.slurmd_pid(node), *sorted(steps), *tasks]

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name} ---\n" + "\n".join(text))
        return "\n".join(out)

    # -------------------------------------------------------------------------------- internals
    def _hosts(self) -> None:
        hosts = Path("/etc/hosts")
        text = hosts.read_text()
        keep = [line for line in text.splitlines() if not line.endswith(HOSTS_MARK)]
        keep += [f"127.0.0.{ADDR_BASE + i} {n} {HOSTS_MARK}" for i, n in enumerate(self.nodes, start=1)]
        new = "\n".join(keep) + "\n"
        if new != text:
            hosts.write_text(new)  # /etc/hosts is often a bind mount: rewrite in place, never rename

    def _write_conf(self) -> None:
        r = self.root
        gres_files = []
        for i in range(self.gpus):
            f = r / "gres" / f"gpu{i}"
            f.touch()
            gres_files.append(str(f))
        base = _free_port_block(len(self.nodes) + 1)
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.{ADDR_BASE + i} Port={base + i} "
            f"CPUs={self.cpus} RealMemory=8000 Gres=gpu:{self.gpus} State=UNKNOWN"
            for i, n in enumerate(self.nodes, start=1))
        self.conf.write_text(f"""\
# written by tests/harness/slurm_cluster.py: {len(self.nodes)} nodes on one host
ClusterName=megarltest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={base}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
MessageTimeout=30
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SchedulerParameters=sched_interval=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
StateSaveLocation={r}/state/ctld
SlurmdSpoolDir={r}/state/slurmd-%n
SlurmctldPidFile={r}/state/slurmctld.pid
SlurmdPidFile={r}/state/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 GraceTime={PREEMPT_GRACE_S}
PartitionName={URGENT_PARTITION} Nodes={','.join(self.nodes)} MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2
""")
        (r / "etc" / "gres.conf").write_text(
            "".join(f"NodeName={n} Name=gpu File={f}\n" for n in self.nodes for f in gres_files))
        (r / "state" / "ctld").mkdir(parents=True, exist_ok=True)

    def _start_munge(self) -> None:
        run = Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.is_file():
            _run(["mungekey", "--create"] if shutil.which("mungekey") else ["create-munge-key"])
            shutil.chown(key, "munge", "munge")
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return  # a munged is already answering
        pid = self.root / "state" / "munged.pid"
        _run(["runuser", "-u", "munge", "--", "munged", "--num-threads=10", "--force"])
        for _ in range(50):
            if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise SlurmUnavailable("munged did not start (munge -n fails)")
        found = subprocess.run(["pgrep", "-n", "munged"], capture_output=True, text=True).stdout.strip()
        if found:
            pid.write_text(found)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "ab")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                           start_new_session=True))

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{' '.join(p.args)} exited {p.returncode}\n{self.log_tail()}")
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                                 env=self.env(), timeout=30)
            last = out.stdout.strip() or out.stderr.strip()
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if out.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster's nodes are not idle after {START_TIMEOUT_S:.0f}s: {last}\n"
                           f"{self.log_tail()}")


def process_environs() -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, environment) of every process this user can read."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(d.name), dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("up", "down"))
    ap.add_argument("--dir", default="/tmp/megarl-slurm")
    ap.add_argument("--nodes", type=int, default=4)
    a = ap.parse_args(argv)
    c = SlurmCluster(a.dir, nodes=a.nodes)
    if a.action == "down":
        c.down()
        return 0
    c.up()
    # the daemons run in their own sessions and outlive this command until `down`
    c.procs = []
    print(f"export SLURM_CONF={c.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
