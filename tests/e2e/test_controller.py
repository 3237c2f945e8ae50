"""`megarl train` end to end on a tiny model: real Megatron trainer, real vLLM generator, real
rewards, weights pushed after every step; then a resumed run continues the same job."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from tests.harness.controller import FP32_MISMATCH_BOUND, _export, _rows, _train

REPO = Path(__file__).resolve().parents[2]


def test_train_runs_end_to_end_and_resumes(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    out = _train(tiny_llama_dir, tmp_path / "a", "controller.steps=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "a" / "tiny-test"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the untrained model's eval
    for key in ("eval/accuracy", "eval/format_rate", "eval/truncated_frac"):
        assert key in rows[0] and key in rows[2]
    for r in rows[1:]:
        # 4 prompts x 2 samples, every phase timed, the loss finite, hacking telemetry present
        assert r["gen/samples"] == 8 and r["train/tokens"] > 0
        busy = [r[f"time/{p}"] for p in ("generate", "reward", "train", "sync")]
        assert all(t > 0 for t in busy) and r["time/idle"] >= 0, r  # each phase ran, and was timed
        assert max(busy) <= r["time/step"], r  # each within its step
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert {"reward/format_rate", "gen/truncated_frac", "gen/mean_length"} <= set(r)
        # the engine samples from exactly the weights the trainer trains (both fp32)
        assert r["train/loss/mismatch"] < FP32_MISMATCH_BOUND, r["train/loss/mismatch"]
    assert "step 2/2" in out.stdout and "generate" in out.stdout  # the per-step phase line
    # the console says what matters: a step's routine waits and weight loads go to the log file only
    # (DEBUG); the engines' start is said once
    log = (run / "logs" / "controller.log").read_text()
    console = out.stdout + out.stderr
    assert "to answer: train step 2" in log and "weights version 2 loaded in" in log
    assert "weights version" not in console
    assert [ln for ln in console.splitlines() if "waiting up to" in ln and "to start" not in ln] == []
    assert (run / "metrics.png").is_file() and any((run / "tensorboard").iterdir())
    assert len((run / "eval_samples.jsonl").read_text().splitlines()) == 8  # 4 replies x 2 evals

    # The trained weights left megarl and differ from the initial ones: the run really trained.
    trained = _export(run / "checkpoints", tmp_path / "hf")
    initial = load_file(tiny_llama_dir / "model.safetensors")
    assert set(trained) == set(initial)
    changed = [k for k in initial if not torch.equal(trained[k].float(), initial[k].float())]
    assert len(changed) > len(initial) // 2, changed

    # Resume: one more step continues at step 3, from the saved state, on the same data stream as
    # a run that never stopped.
    out = _train(tiny_llama_dir, tmp_path / "a", "controller.steps=3", "trainer.resume_from=auto")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resuming from" in out.stdout
    resumed = _rows(run)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]  # no second baseline on resume
    straight = _train(tiny_llama_dir, tmp_path / "b", "controller.steps=3", "controller.eval_every=0")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    assert [r["data/prompts_crc32"] for r in resumed[1:]] == \
        [r["data/prompts_crc32"] for r in _rows(tmp_path / "b" / "tiny-test")]


# trainer.tp=2 alone is under slow (CI time): the tp2 -> generator tp2 row covers it
@pytest.mark.parametrize("layout", [pytest.param(("trainer.tp=2",), marks=pytest.mark.slow), ("trainer.pp=2", "sync.transport=p2p"),
                                    ("cluster.trainer_cpus=0", "generator.threads_bind=1"),
                                    ("trainer.dp=2", "controller.max_policy_lag=1"),
                                    ("trainer.tp=2", "generator.tp=2", "generator.threads_bind=0|1",
                                     "controller.max_policy_lag=1")], ids=str)
def test_train_multi_rank_trainer_over_ddma(tiny_llama_dir, tmp_path, layout):
    """`megarl train` with a TP2 / PP2 / DP2 trainer (ranks in their own processes), sync and async,
    into a TP1 or TP2 engine: it trains, and every sync goes through DDMA with the checksums on and
    the logprob probe passing."""
    out = _train(tiny_llama_dir, tmp_path, *layout, "controller.steps=2", "controller.eval_every=0",
                 "trainer.checkpoint_interval=0", "sync.probe_every=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _rows(tmp_path / "tiny-test")
    assert [r["step"] for r in rows] == [1, 2]
    if "cluster.trainer_cpus=0" in layout:  # trainer on core 0, the engine on core 1
        assert "trainer ranks pinned: rank 0 cores [0]" in out.stderr + out.stdout
    for r in rows:
        assert r["sync/verified"] == 1.0 and r["sync/bytes_sent"] > 0
        assert r["sync/probe_gap"] < 1e-3  # fp32 engine and trainer: the probe's fp32 bound (controller/weight_sync.py)
        assert r["train/grad_norm"] > 0


# lag 1 in every run; 0 (the sync baseline, also in test_train_runs_end_to_end_and_resumes) and 2 under slow (CI time)
@pytest.mark.parametrize("lag", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow)])
def test_train_policy_lag_bound(tiny_llama_dir, tmp_path, lag):
    """controller.max_policy_lag, read from trained_samples.jsonl (the policy versions of every
    trained sample's tokens, as the generator stamped them), not from the controller's own lag/*
    metrics: no trained token is older than the bound; lag 0 is strictly on-policy; with lag > 0 the
    run reaches the bound itself.

    Why the bound is reached, every run: ``fill(1)`` submits batches 1 .. 1 + lag at once while the
    engines hold version 0 (the first push is synchronous), and they stay at version 0 until batch 1
    is finished, scored and trained. One engine admits all of them together (max_num_seqs 256 >= 3
    batches x 8 sequences of <= 8 new tokens), so batch 1 + lag decodes beside batch 1, at version 0,
    and is trained at step 1 + lag, trainer version lag: lag exactly ``lag``. steps=4 >= 1 + 2 keeps
    that batch inside the run at lag 2 and leaves a second chance (batch 4, from version 1)."""
    out = _train(tiny_llama_dir, tmp_path, f"controller.max_policy_lag={lag}", "controller.steps=4",
                 "controller.eval_every=0", "trainer.checkpoint_interval=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "tiny-test"
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
    trained = _trained(run)
    assert sorted(trained) == [1, 2, 3, 4]
    oldest = 0  # the largest lag of any trained token in the run
    for step, samples in trained.items():
        assert len(samples) == 4 * 2, step  # prompts_per_step x n_samples of tiny_test.yaml
        version = step - 1  # step s trains on the weights of version s - 1 (s - 1 updates so far)
        for uid, rec in samples.items():
            if rec["tokens"] == 0:
                continue  # no token, no version (recorded as [-1, -1])
            first, last = rec["versions"]
            assert 0 <= first <= last <= version, (step, uid, rec)  # no token from the future
            assert version - first <= lag, (step, uid, rec)  # its oldest token within the bound
            oldest = max(oldest, version - first)
    assert oldest == lag, oldest


def _trained(run: Path) -> dict[int, dict[str, dict]]:
    """trained_samples.jsonl: step -> sample id -> record."""
    lines = (run / "trained_samples.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len({r["step"] for r in rows}) == len(rows), "a step was recorded twice"
    return {r["step"]: {s["id"]: s for s in r["samples"]} for r in rows}


@pytest.mark.slow  # CI time: the kill matrix's point 00 and the deterministic kill test cover kill + resume in every run
def test_async_kill_then_resume_trains_every_sample_once(tiny_llama_dir, tmp_path):
    """max_policy_lag=1 with partial rollouts (batches generating ahead of the trainer, cut every
    4 tokens): SIGKILL the controller mid-run, resume with trainer.resume_from=auto. The sample ids
    trained are exactly those of a run that never stopped, each once, on the same prompts; the
    samples the checkpoint held finished are trained bit for bit as they were generated (CRC of
    their tokens, versions), and those it held unfinished continue from their saved rounds."""
    import signal
    import time

    common = ("controller.max_policy_lag=1", "controller.steps=4", "controller.eval_every=0",
              "generator.round_token_budget=4")
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
           f"model.path={tiny_llama_dir}", f"logging.out_dir={tmp_path / 'a'}", "trainer.checkpoint_interval=1",
           "algorithm.entropy_coef=0.01", *common, "controller.steps=40"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = tmp_path / "a" / "tiny-test"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    saved_step = json.loads((ckpt / "controller_state.json").read_text())["policy_version"]
    state = json.loads((ckpt / "controller_state.json").read_text())["rollouts"]
    assert list(state["pending"]) == [str(saved_step + 1)]  # lag 1: the next batch was admitted ahead
    step_of = {g: int(k) for k, p in state["pending"].items() for g in p["groups"]}
    finished = {f"s{step_of[int(g)]}p{s['prompt_index']}k{s['sample_index']}": s
                for g, rows in state["finished"].items() for s in rows}
    unfinished = {f"s{step_of[t['group_id']]}p{t['prompt_index']}k{t['sample_index']}": t
                  for t in state["unfinished"]}
    assert len(finished) + len(unfinished) == 4 * 2  # prompts_per_step x n_samples of tiny_test.yaml

    out = _train(tiny_llama_dir, tmp_path / "a", *common, "trainer.resume_from=auto")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{len(finished)} finished sample(s) kept, {len(unfinished)} partial rollout(s)" in out.stdout
    trained = _trained(run)
    rows = _rows(run)
    steps = [r["step"] for r in rows]
    assert steps == [1, 2, 3, 4] and sorted(trained) == [1, 2, 3, 4], (steps, sorted(trained))
    straight = _train(tiny_llama_dir, tmp_path / "b", *common)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    want = _trained(tmp_path / "b" / "tiny-test")
    assert {s: set(ids) for s, ids in trained.items()} == {s: set(ids) for s, ids in want.items()}
    want_crc = {r["step"]: r["data/prompts_crc32"] for r in _rows(tmp_path / "b" / "tiny-test")}
    assert {r["step"]: r["data/prompts_crc32"] for r in rows} == want_crc
    assert saved_step <= 3, saved_step  # killed after its first logged step (a step takes seconds)
    after = trained[saved_step + 1]
    for uid, s in finished.items():
        got = after[uid]
        assert got["crc32"] == zlib.crc32(repr(s["completion_ids"]).encode()), uid
        assert got["versions"] == [min(s["versions"]), max(s["versions"])], uid
    for uid, t in unfinished.items():
        got = after[uid]
        assert got["tokens"] >= len(t["ids"]), uid
        if t["vers"]:
            assert got["versions"][0] == min(t["vers"]), uid


def test_train_below_temperature_one_matches_the_engines_logprobs(tiny_llama_dir, tmp_path):
    """Sampling at T=0.7 with logprobs_mode 'processed': the engine reports log_softmax(logits / 0.7)
    of what it sampled, the trainer divides by trainer.logprob_temperature=0.7, and with both in fp32
    the two agree to FP32_MISMATCH_BOUND on every trained token. (That the untempered distribution
    differs measurably: tests/e2e/test_generator.py; that a trainer temperature other than the engine's
    is refused before anything starts: tests/unit/test_trainer_config.py.)"""
    out = _train(tiny_llama_dir, tmp_path, "controller.steps=2", "controller.eval_every=0",
                 "trainer.checkpoint_interval=0", "generator.temperature=0.7", "trainer.logprob_temperature=0.7")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _rows(tmp_path / "tiny-test")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 <= r["train/loss/mismatch"] < FP32_MISMATCH_BOUND, r["train/loss/mismatch"]


def test_train_with_the_quickstarts_numerics(tiny_llama_dir, tmp_path):
    """The quickstart's own numerics, which tiny_test.yaml pins back for the other tests: a bf16
    trainer (fp32 master weights) syncing into the fp32 engine, sampling at T=0.7 with the trainer's
    logprobs at 0.7. It trains, every sync is verified and probed within the bf16 bound (0.25 nats,
    megarl/controller/weight_sync.py), and the mismatch is the bf16 forward's rounding: above the fp32
    bound (the trainer really runs bf16: bf16 keeps 8 significant bits, a relative rounding of up to
    2^-9 ~ 2e-3 on every weight and activation, which moves logprobs by ~1e-2 nats, 100x the fp32
    bound's 1e-4) and below the bf16 probe bound."""
    qs = {"trainer.params_dtype": "bfloat16", "generator.temperature": "0.7", "trainer.logprob_temperature": "0.7"}
    from megarl.config import load_config

    shipped = load_config(str(REPO / "configs" / "quickstart.yaml"), ["cluster.device=cpu"])
    assert (shipped.trainer.params_dtype, shipped.generator.temperature, shipped.trainer.logprob_temperature,
            shipped.generator.dtype) == ("bfloat16", 0.7, 0.7, "float32")  # what this test stands for
    out = _train(tiny_llama_dir, tmp_path, "controller.steps=2", "controller.eval_every=0", "trainer.checkpoint_interval=0",
                 "sync.probe_every=1", *(f"{k}={v}" for k, v in qs.items()))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _rows(tmp_path / "tiny-test")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sync/verified"] == 1.0 and r["train/grad_norm"] > 0
        assert r["sync/probe_gap"] < 0.25, r["sync/probe_gap"]
        assert FP32_MISMATCH_BOUND < r["train/loss/mismatch"] < 0.25, r["train/loss/mismatch"]
