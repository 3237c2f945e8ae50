"""algorithm.dynamic_sampling (DAPO) on the real stack (Megatron trainer, vLLM generator, DDMA) with the
tiny random model: all-equal reward groups are dropped and the step refilled from further prompts of
the one data cursor; every prompt consumed is trained once or dropped once, also across a kill in the
middle of a refill; a step whose refill rounds are spent still trains (padded) and says so once.

The reward (``ds_reward:judge``, written to a side folder on PYTHONPATH, loaded as users load theirs):
the tiny model's replies end early at the stop strings (e, a, o), so most are scored, not truncated;
a scored reply is right when its text's CRC32 is even, so a group's rewards usually vary. Prompts
whose gold answer is a multiple of 3 are **planted**: every reply is wrong (a truncated one scores
``wrong`` too), so their groups are always all-equal. ``DS_ALL_EQUAL=1`` plants every prompt.

Planted breaks seen failing, then restored:
* not dropping (``DynamicSampling._split`` returning every group as varying): a planted group trained
  with rewards [0, 0, 0, 0] (test_planted_all_equal_groups_are_dropped_and_refilled);
* refills re-reading the cursor's prompts (``RolloutQueue.refill`` not advancing ``next_prompt``):
  stream position 8 consumed twice (the same test's accounting);
* the cursor not restored on resume (``load_state_dict`` ignoring ``next_prompt``, so the cursor is
  derived from the step as before refills existed): position 12 consumed twice, by a refill of the
  killed run's checkpointed steps and by the resumed batches (test_kill_mid_refill_loses_and_repeats_no_prompt);
* an unbounded refill (``max_refill_rounds`` ignored): refills without end
  (test_selection_refills_what_is_missing_and_pads_when_rounds_are_spent).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megarl.controller.rollouts import prompts_crc32

REPO = Path(__file__).resolve().parents[2]
PER_STEP, N = 4, 4

REWARD = '''
import os, zlib

def planted(gold):
    return os.environ.get("DS_ALL_EQUAL") == "1" or int(gold) % 3 == 0

def judge(completion, gold, *, strict):
    return not planted(gold) and zlib.crc32(completion.encode()) % 2 == 0
'''


def _side(tmp_path: Path) -> dict:
    side = tmp_path / "side"
    side.mkdir(exist_ok=True)
    (side / "ds_reward.py").write_text(REWARD)
    return dict(os.environ, PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join(p for p in (str(side), os.environ.get("PYTHONPATH", "")) if p))


def _overrides(model_dir: Path, out_dir: Path, steps: int, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", f"logging.out_dir={out_dir}", f"controller.steps={steps}",
            "controller.eval_every=0", "logging.tensorboard=false", "generator.stop=[e,a,o]",
            "reward.fn=ds_reward:judge", f"generator.n_samples={N}", f"controller.prompts_per_step={PER_STEP}",
            "algorithm.entropy_coef=0.01", *extra]


def _cmd(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"), *overrides]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train(overrides: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(_cmd(overrides), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _prompt_source(overrides: list[str], env: dict):
    """The run's prompt stream, read as the controller reads it (position -> task and prompt ids)."""
    import importlib

    from megarl.config import load_config
    from megarl.controller.prompts import PromptSource

    side = env["PYTHONPATH"].split(os.pathsep)[0]  # the validator finds the reward module as the job does
    sys.path.insert(0, side)
    importlib.invalidate_caches()
    try:
        cfg = load_config(REPO / "configs" / "tiny_test.yaml", overrides)
    finally:
        sys.path.remove(side)
    return PromptSource(cfg, Path(cfg.model.path))


def _gold_planted(gold: str, all_equal: bool = False) -> bool:
    return all_equal or int(gold) % 3 == 0


def _check_accounting(run: Path, steps: int, prompts, *, all_equal: bool = False) -> list[dict]:
    """Over the whole run: each stream position consumed once (trained or dropped), contiguous from 0;
    each step trains prompts_per_step groups, the ones its record says, none all-equal unless padding;
    every planted prompt dropped or padding; the metrics match the records. Returns the records."""
    records = _jsonl(run / "dynamic_sampling.jsonl")
    metrics = _jsonl(run / "metrics.jsonl")
    trained = {r["step"]: r["samples"] for r in _jsonl(run / "trained_samples.jsonl")}
    assert [r["step"] for r in records] == [m["step"] for m in metrics] == sorted(trained) == list(range(1, steps + 1))
    positions = [g["prompt"] for r in records for g in r["groups"]]
    assert sorted(positions) == list(range(len(positions))), positions  # none repeated, none skipped
    for record, row in zip(records, metrics):
        step, groups = record["step"], record["groups"]
        fates = [g["fate"] for g in groups]
        assert [g["index"] for g in groups] == list(range(len(groups)))  # the batch's 0..P-1, then refills'
        trained_groups = [g for g in groups if g["fate"] in ("trained", "padding")]
        assert len(trained_groups) == PER_STEP, record
        # the trainer got exactly those groups: their sample ids, n_samples each
        assert sorted(s["id"] for s in trained[step]) == sorted(f"s{step}p{g['index']}k{k}"
                                                               for g in trained_groups for k in range(N))
        for g in groups:
            equal = len(set(g["rewards"])) == 1
            assert len(g["rewards"]) == N and equal == (g["fate"] != "trained"), (step, g)
            task = prompts.train[g["prompt"] % len(prompts.train)][0]
            if _gold_planted(task.answer, all_equal):
                assert g["fate"] in ("dropped", "padding") and g["rewards"] == [0.0] * N, (step, g, task.answer)
        assert row["batch/dropped_groups"] == fates.count("dropped")
        assert row["batch/padded_groups"] == fates.count("padding")
        assert row["batch/refill_rounds"] == record["refill_rounds"]
        assert (record["refill_rounds"] == 0) == (len(groups) == PER_STEP)  # a round takes >= 1 further prompt
        # the step's data CRC is its batch's: the PER_STEP prompts it admitted first
        first = groups[0]["prompt"]
        ids = [prompts.train[p % len(prompts.train)][1] for p in range(first, first + PER_STEP)]
        assert row["data/prompts_crc32"] == prompts_crc32(ids)
    return records


def test_planted_all_equal_groups_are_dropped_and_refilled(tiny_llama_dir, tmp_path):
    """3 steps at max_policy_lag 1 (the next batch generates while a step refills): planted groups
    dropped, refills taken from the cursor after the batch admitted ahead, the batch kept at 4 groups."""
    steps = 3
    overrides = _overrides(tiny_llama_dir, tmp_path, steps, "algorithm.dynamic_sampling=true",
                           "algorithm.max_refill_rounds=8", "controller.max_policy_lag=1")
    env = _side(tmp_path)
    out = _train(overrides, env)
    run = tmp_path / "tiny-test"
    records = _check_accounting(run, steps, _prompt_source(overrides, env))
    dropped = sum(g["fate"] == "dropped" for r in records for g in r["groups"])
    assert dropped >= 1 and sum(r["refill_rounds"] for r in records) >= 1  # the planted prompts are ~1 in 3
    assert not any(g["fate"] == "padding" for r in records for g in r["groups"])  # 8 rounds are plenty here
    assert "refill round 1" in out.stderr + out.stdout
    # with the lag, step s + 1's batch was admitted before step s refilled: step s's refills come from the
    # cursor after it, and step s + 1 trains the batch it was admitted with
    for r, following in zip(records, records[1:]):
        if r["refill_rounds"]:
            assert min(g["prompt"] for g in r["groups"][PER_STEP:]) == following["groups"][0]["prompt"] + PER_STEP


def test_off_is_the_batch_as_it_was(tiny_llama_dir, tmp_path):
    """dynamic_sampling false (the default): step s trains stream positions (s-1)*P.. and nothing else,
    all-equal groups included, no record file, the batch/* metrics 0 on every row."""
    steps = 1
    overrides = _overrides(tiny_llama_dir, tmp_path, steps)
    env = _side(tmp_path)
    _train(overrides, env)
    run = tmp_path / "tiny-test"
    prompts = _prompt_source(overrides, env)
    assert not (run / "dynamic_sampling.jsonl").exists()
    metrics = _jsonl(run / "metrics.jsonl")
    trained = {r["step"]: r["samples"] for r in _jsonl(run / "trained_samples.jsonl")}
    for row in metrics:
        step = row["step"]
        assert (row["batch/dropped_groups"], row["batch/refill_rounds"], row["batch/padded_groups"]) == (0, 0, 0)
        assert sorted(s["id"] for s in trained[step]) == sorted(f"s{step}p{i}k{k}" for i in range(PER_STEP)
                                                                for k in range(N))
        assert row["data/prompts_crc32"] == prompts_crc32(prompts.batch(step - 1, PER_STEP)[1])


class _Refills:
    """RolloutQueue's refill as the selection sees it: ``count`` prompts from the cursor, one group each."""

    def __init__(self, first_position: int):
        self.next_prompt, self.asked, self._group = first_position, [], 1000

    def refill(self, step, count, first_index, trainer_version):
        self.asked.append(count)
        assert len(self.asked) <= 50, "refills without end"
        return _groups(step, range(first_index, first_index + count),
                       range(self.next_prompt, self._advance(count)), self)

    def _advance(self, count):
        self.next_prompt += count
        return self.next_prompt


def _groups(step, indices, positions, source):
    from megarl.controller.rollouts import StepRollouts
    from megarl.rollout import Sample

    indices, positions = list(indices), list(positions)
    samples = []
    for index in indices:
        source._group += 1
        samples += [Sample([1], [2], [0.0], [0], "stop", group_id=source._group, sample_index=k, prompt_index=index,
                           uid=f"s{step}p{index}k{k}") for k in range(N)]
    return StepRollouts([f"task{p}" for p in positions], [[p] for p in positions], samples, positions,
                        first_index=indices[0])


def _select(sampling, step, varying_positions, refills):
    """One step through DynamicSampling.select: its batch at positions refills.next_prompt - PER_STEP..;
    a group varies when its stream position is in ``varying_positions``."""
    from megarl.utils.metrics import PhaseTimer

    first = refills.next_prompt - PER_STEP
    batch = _groups(step, range(PER_STEP), range(first, first + PER_STEP), refills)

    def score(tasks, samples):  # the reward: a varying group scores 0, 1, 0, 1
        for s in samples:
            position = int(tasks[s.prompt_index][4:])
            s.reward = float(s.sample_index % 2) if position in varying_positions else 0.0
        return samples, {"reward/errors": 1.0}

    counts = score(batch.tasks, batch.samples)[1]
    samples, metrics, record = sampling.select(step, batch, refills, score, 0, PhaseTimer(), counts)
    return samples, metrics, record, counts


def test_selection_refills_what_is_missing_and_pads_when_rounds_are_spent(tmp_path, caplog):
    """Without the stack: each round asks for exactly the groups still missing, from the cursor;
    spent rounds pad with the first dropped groups and warn once per run, not per step; the refills'
    reward counts are added. Planted break seen failing: max_refill_rounds ignored (refills without end)."""
    import logging

    from megarl.controller.dynamic_sampling import DynamicSampling

    sampling = DynamicSampling(enabled=True, max_refill_rounds=3, prompts_per_step=PER_STEP, run_dir=tmp_path)
    refills = _Refills(PER_STEP)
    # batch 0..3: 1 and 3 vary; round 1 asks 2 (4, 5: 5 varies); round 2 asks 1 (6 varies): done
    samples, metrics, record, counts = _select(sampling, 1, {1, 3, 5, 6}, refills)
    assert refills.asked == [2, 1] and refills.next_prompt == 7
    assert metrics == {"batch/dropped_groups": 3.0, "batch/refill_rounds": 2.0, "batch/padded_groups": 0.0}
    assert sorted({s.prompt_index for s in samples}) == [1, 3, 5, 6] and len(samples) == PER_STEP * N
    assert [(g["index"], g["prompt"], g["fate"]) for g in record["groups"]] == \
        [(0, 0, "dropped"), (1, 1, "trained"), (2, 2, "dropped"), (3, 3, "trained"), (4, 4, "dropped"),
         (5, 5, "trained"), (6, 6, "trained")]
    assert counts == {"reward/errors": 3.0}  # the batch's and two rounds'

    with caplog.at_level(logging.WARNING, logger="megarl"):
        for step in (2, 3):  # nothing varies: 3 rounds of 4, then the batch's own 4 groups as padding
            refills.asked.clear()
            refills.next_prompt += PER_STEP  # the step's batch, admitted from the cursor
            samples, metrics, record, _ = _select(sampling, step, set(), refills)
            assert refills.asked == [PER_STEP] * 3
            assert metrics == {"batch/dropped_groups": 12.0, "batch/refill_rounds": 3.0, "batch/padded_groups": 4.0}
            assert sorted({s.prompt_index for s in samples}) == [0, 1, 2, 3]
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert len(caplog.records) == 1 and "step 2 has 0 of" in caplog.records[0].getMessage()

    off = DynamicSampling(enabled=False, max_refill_rounds=3, prompts_per_step=PER_STEP, run_dir=tmp_path)
    samples, metrics, record, _ = _select(off, 4, set(), _Refills(PER_STEP))
    assert len(samples) == PER_STEP * N and record == {} and set(metrics.values()) == {0.0}


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_kill_mid_refill_loses_and_repeats_no_prompt(tiny_llama_dir, tmp_path):
    """SIGKILL the controller while a refill of step >= 2 is under way (held at its pause point), after
    checkpoints whose cursor is past earlier refills; the rerun resumes and finishes: over the whole run
    every stream position is trained once or dropped once, none repeated, none lost."""
    steps = 3
    overrides = _overrides(tiny_llama_dir, tmp_path, steps, "algorithm.dynamic_sampling=true",
                           "algorithm.max_refill_rounds=8", "controller.max_policy_lag=1",
                           "controller.deterministic=true", "trainer.checkpoint_interval=1")
    env = _side(tmp_path)
    run = tmp_path / "tiny-test"
    log_path = tmp_path / "first.log"
    pauses = ",".join(f"refill@{s}=300" for s in range(2, steps + 1))
    with open(log_path, "w") as log:
        job = subprocess.Popen(_cmd(overrides), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                               env=dict(env, MEGARL_FAULT_PAUSE=pauses))
    killed_at = None
    try:
        deadline = time.monotonic() + 400
        while job.poll() is None and time.monotonic() < deadline and killed_at is None:
            for line in log_path.read_text(errors="replace").splitlines():
                if "refill round 1:" in line and "step 1 " not in line:
                    killed_at = int(line.split("dynamic_sampling: step ")[1].split()[0])
                    break
            time.sleep(0.1)
        assert killed_at is not None and job.poll() is None, log_path.read_text()[-3000:]
        family = _family(job.pid)
        job.send_signal(signal.SIGKILL)
        job.wait(30)
        gone, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, alive  # the executors follow their controller (no stray engine on the cores)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    # the killed step never logged; the checkpoint before it holds a cursor past earlier refills
    assert len(_jsonl(run / "metrics.jsonl")) == killed_at - 1
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    state = json.loads((ckpt / "controller_state.json").read_text())
    assert state["policy_version"] == killed_at - 1
    recorded = {g["prompt"] for r in _jsonl(run / "dynamic_sampling.jsonl") for g in r["groups"]}
    pending = state["rollouts"]["pending"]
    assert list(pending) == [str(killed_at)]  # lag 1: the killed step's batch was admitted ahead
    # the cursor: past every position the logged steps consumed and the batch admitted ahead, which
    # holds exactly the positions they did not
    first = pending[str(killed_at)]["first_prompt"]
    assert state["rollouts"]["next_prompt"] == len(recorded) + PER_STEP
    assert set(range(len(recorded) + PER_STEP)) - recorded == set(range(first, first + PER_STEP))

    again = _train(overrides, env)
    assert f"resuming at step {killed_at - 1}" in again.stderr + again.stdout
    records = _check_accounting(run, steps, _prompt_source(overrides, env))
    assert any(r["refill_rounds"] for r in records if r["step"] < killed_at)  # the checkpoint's cursor moved
    assert records[killed_at - 1]["refill_rounds"] >= 1  # the killed step refilled again, from the same cursor


def test_spent_refill_rounds_train_the_padded_batch_and_warn_once(tiny_llama_dir, tmp_path):
    """Every group all-equal: each step takes max_refill_rounds=2 rounds, then trains its own batch
    (the first groups consumed, advantage 0: the entropy bonus gives the gradient), the refills' prompts
    recorded as dropped; one WARNING in the run, not one a step, and the run ends."""
    steps = 2
    overrides = _overrides(tiny_llama_dir, tmp_path, steps, "algorithm.dynamic_sampling=true",
                           "algorithm.max_refill_rounds=2")
    env = dict(_side(tmp_path), DS_ALL_EQUAL="1")
    out = _train(overrides, env, timeout=400)
    run = tmp_path / "tiny-test"
    records = _check_accounting(run, steps, _prompt_source(overrides, env), all_equal=True)
    for r in records:
        assert r["refill_rounds"] == 2
        # the batch's own 4 prompts train (padding); 2 rounds x 4 further prompts are dropped
        assert [g["fate"] for g in r["groups"]] == ["padding"] * PER_STEP + ["dropped"] * 2 * PER_STEP
    rows = _jsonl(run / "metrics.jsonl")
    assert [(m["batch/dropped_groups"], m["batch/padded_groups"], m["batch/refill_rounds"]) for m in rows] == \
        [(8.0, 4.0, 2.0)] * steps
    assert all(m["train/grad_norm"] > 0 for m in rows)  # it trained
    log = out.stdout + out.stderr
    assert log.count("after algorithm.max_refill_rounds=2 refill round(s)") == 1, log[-3000:]
