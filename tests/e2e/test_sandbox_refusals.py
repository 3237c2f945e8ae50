"""The code sandbox refuses, in one line naming the knob, where it would be weaker than designed: a
mechanism the machine lacks (unless reward.code_sandbox_allow_weaker names it), slot uids that are
real users or groups. Each test names the break it was seen failing on (planted by hand, then restored)."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from megarl.reward import RewardConfig, RewardPool, cgroups, jail, sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (uid switch, namespaces)")
TASK = {"prompt": "def add(a, b):\n", "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
        "entry_point": "add"}
GOOD = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def fresh_sandbox():
    """The sandbox's knobs and machine check start from defaults and are put back afterwards."""
    root = cgroups.ROOT
    sandbox.configure()
    size = jail.WORK_TMPFS_MB
    yield
    cgroups.ROOT, jail.WORK_TMPFS_MB = root, size
    sandbox.configure()


def test_a_missing_mechanism_is_refused_in_one_line_unless_accepted(fresh_sandbox, tmp_path, caplog):
    # Fails with the refusal planted off (check_sandbox: a cgroup probe failure always added to `weaker`):
    # the sandbox then runs without per-run limits and says nothing.
    cgroups.ROOT = tmp_path  # a cgroupfs with no controllers: what a container without one shows
    with pytest.raises(sandbox.SandboxError) as err:
        sandbox.check_sandbox()
    line = str(err.value)
    assert "\n" not in line and "cgroup" in line and "reward.code_sandbox_allow_weaker=[cgroup]" in line, line
    sandbox.configure(allow_weaker=["cgroup"])
    with caplog.at_level(logging.WARNING, logger="megarl.reward.sandbox"):
        verdict = sandbox.run_tests(GOOD, TASK["test"], "add", timeout_s=10)
    assert verdict.passed, verdict.reason
    assert "running WITHOUT ['cgroup']" in caplog.text
    assert sorted(os.listdir(tmp_path)) == []  # no cgroup was made there: the run went without one


def test_a_jail_step_the_kernel_refuses_is_refused_at_start_unless_accepted(fresh_sandbox, caplog):
    # Fails with the probe planted to go on without a failed step (check_sandbox: `weaker.add(exc.mechanism);
    # continue` whatever the knob says): replies then run without the mount namespace, silently.
    jail.WORK_TMPFS_MB = "bogus"  # the kernel refuses this tmpfs (EINVAL): a mount the jail cannot make
    with pytest.raises(sandbox.SandboxError) as err:
        sandbox.check_sandbox()
    line = str(err.value)
    assert "\n" not in line and "mount" in line and "reward.code_sandbox_allow_weaker=[mount]" in line, line
    sandbox.configure(allow_weaker=["mount"])
    with caplog.at_level(logging.WARNING, logger="megarl.reward.sandbox"):
        verdict = sandbox.run_tests(GOOD + "import os\nassert os.getcwd() != '/work'\n", TASK["test"], "add",
                                    timeout_s=10)
    assert verdict.passed, verdict.reason  # the weaker sandbox, in a host dir, as accepted
    assert "running WITHOUT ['mount']" in caplog.text
    assert "a dataset's gold solutions included" in caplog.text  # what a weaker view costs, said where it is chosen


def test_slot_uids_that_are_users_are_refused(fresh_sandbox):
    # Fails with the check planted off (check_sandbox: taken = []): runs then sweep (kill) the processes
    # of uid 65534, a real user ('nobody'), as their own.
    sandbox.configure(uid_base=65534 - 100)
    with pytest.raises(sandbox.SandboxError) as err:
        sandbox.check_sandbox()
    line = str(err.value)
    assert "\n" not in line and "65534 (user nobody)" in line and "reward.code_sandbox_uid_base" in line, line
    assert sandbox.taken_uids(61000, sandbox.SLOTS + 1) == []  # the default range is free here


def test_the_knobs_reach_the_scoring_processes():
    # Fails with the pool not passing them (planted: _sandbox_knobs returns {}): the workers start.
    cfg = RewardConfig(fn="code", workers=1, timeout_s=5.0, code_sandbox_uid_base=65534 - 100)
    with pytest.raises(Exception) as err:
        with RewardPool(cfg, max_new_tokens=64) as pool:
            pool.score_texts([GOOD], [json.dumps(TASK)], ["stop"], [5])
    assert "65534 (user nobody)" in str(err.value), err.value
    with pytest.raises(ValueError, match="code_sandbox_allow_weaker"):
        RewardConfig(fn="code", code_sandbox_allow_weaker=["network"])
    with pytest.raises(sandbox.SandboxError, match="unknown mechanism"):
        sandbox.configure(allow_weaker=["network"])


def test_the_tester_server_restarts_and_leaves_no_tester_behind():
    # Fails with testers.start neither checking the server nor retrying (planted: the `poll()` test and
    # the retry removed): the run after the server's death raises instead of scoring.
    from megarl.reward import testers

    hang = "def add(a, b):\n    while True:\n        pass\n"
    assert not sandbox.run_tests(hang, TASK["test"], "add", timeout_s=1).passed  # a tester killed mid-test
    old = testers._zygote.proc
    old.kill()
    old.wait(timeout=5)
    verdict = sandbox.run_tests(GOOD, TASK["test"], "add", timeout_s=10)
    assert verdict.passed, verdict.reason
    zygote = testers._zygote.proc.pid
    assert zygote != old.pid
    end = time.monotonic() + 5  # a killed process takes a moment to exit
    while [p for p in sandbox.alive(65534) if _ppid(p) == zygote] and time.monotonic() < end:
        time.sleep(0.05)
    children = [p for p in sandbox.alive(65534) if _ppid(p) == zygote]
    assert children == [], children  # each run's tester ended with it (the kernel reaps them)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return -1
