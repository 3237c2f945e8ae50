"""TrainerExecutor: TP2, PP2 and DP2 Megatron ranks in their own processes train like the
single-rank LocalTrainer, sync into a real vLLM engine over DDMA, stop naming a killed or frozen
rank (no rank process left), and resume from their own checkpoints.

Every executor here starts 2 rank processes (~5 s on 2 cores), pinned one core each.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.trainer.executor import TrainerExecutor, TrainerRankFailed, TrainerTimeout, rank_coords, rank_cores
from megarl.batch import RolloutBatch
from megarl.trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parents[2]
CPUS = [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None
# TIS needs the proximal pass and kl_coef the reference model: both no-grad passes run on every layout.
ALGO = AlgorithmConfig(loss="aipo", tis="token", kl_coef=0.01)
LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}

# Tolerance for a TP/PP/DP step against the single-rank step (fp32, unit roundoff u = 2^-24 = 6e-8).
# The layouts compute the same sums in another order: TP2 splits the K-dim of linear_proj/linear_fc2
# into two partial sums (all-reduced) and the vocab-parallel log-softmax's max and sum into two
# shards; DP2 sums the two ranks' gradients after each accumulated its own; PP2 moves activations
# between processes and batches the GEMMs differently. A reordered fp32 dot product of length K
# moves by ~sqrt(K) * u relative (random-walk rounding; the worst case K * u is never approached):
# K <= 512 here -> ~1.4e-6 of O(1) activations and logits, so a token's logprob moves by
# D ~ 1e-6 nats (measured ~2e-7). Every metric is a smooth function f of the logprobs, so
# |df| <= |f'| * D: the loss, pg_loss and kl_ref are means of logprobs (relative error <= D / |lp|),
# IS weights exp(lp - mu) and ESS carry D as relative error -> rel_tol 1e-5 (10 D). Near-zero
# metrics have a small |f'|: KL(mu || pi) ~ mean(d^2) / 2 with d = lp - mu ~ 0.05 (the batch's
# noise), so |df| ~ |d| * D = 5e-8 -> abs_tol 1e-7 (its relative error, 2D/|d| = 4e-5, would not
# fit rel_tol). Step 2 adds Adam's update lr * g / (|g| + eps): it differs only where g is within
# the noise of 0, which moves the loss by g * dw ~ 0 at first order, so step 2 keeps the bound.
# The grad norm (a sum of 6.3M squares) carries the grads' relative error. Measured worst: 2.6e-6
# relative (TP2, IS weight max at step 2), 1e-8 absolute (TP2, KL at step 1).
RTOL, ATOL = 1e-5, 1e-7
EXACT = ("tokens", "lr", "update_successful")  # counts and schedule: no arithmetic to reorder


def _cfg(tp: int = 1, pp: int = 1, dp: int = 1, **kw) -> TrainerConfig:
    return TrainerConfig(tp=tp, pp=pp, dp=dp, lr=1e-3, micro_batch_size=2, grad_clip=1.0, **kw)


def _executor(model_dir, run_dir, layout=(1, 1, 1), devices=None, **kw) -> TrainerExecutor:
    return TrainerExecutor(_cfg(*layout, **kw), ALGO, model_dir, total_steps=4, run_dir=run_dir, cpus=CPUS,
                           devices=devices)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory):
    """A fixed batch (behaviour logprobs near the initial policy's, advantages +-1) and the
    single-rank LocalTrainer's metrics for two steps on it."""
    from megarl.trainer.local import LocalTrainer
    from megarl.trainer.logprobs import compute_logprobs

    trainer = LocalTrainer(_cfg(), ALGO, tiny_llama_dir, total_steps=4, run_dir=tmp_path_factory.mktemp("local"))
    try:
        g = torch.Generator().manual_seed(0)
        lengths = [10, 7, 12, 9]
        tokens = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
        batch = RolloutBatch.from_sequences(tokens, [[0.0] * 4 + [1.0] * (n - 4) for n in lengths],
                                            advantages=[1.0, -1.0, 1.0, -1.0], versions=[[0] * n for n in lengths])
        lp = compute_logprobs(trainer.model, batch).logprobs
        behav = (lp + 0.05 * torch.randn(lp.shape, generator=g)) * batch.loss_mask
        batch = RolloutBatch(**{**batch.__dict__, "behav_logprobs": behav})
        steps = [trainer.step(batch) for _ in range(2)]
    finally:
        trainer.close()
    return batch, steps


def test_rank_coords_and_cores():
    # megatron's tp-cp-ep-dp-pp order: tp fastest, then dp, then pp
    assert [tuple(rank_coords(r, 2, 2, 2)[k] for k in ("tp", "dp", "pp")) for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert [rank_coords(r, 1, 2, 1)["pp"] for r in range(2)] == [0, 1]
    assert rank_cores([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3, 4]]
    assert rank_cores([0, 1], 4) == [[0], [1], [0], [1]]
    assert rank_cores(None, 2) == [None, None]
    with pytest.raises(ValueError):
        rank_cores([], 2)


def test_build_marks_tp_sharded_weights_like_megatron_init(tiny_llama_dir):
    """init_weights=False + set_tp_attributes gives the attributes megatron's random init sets
    (without them TP's grad norm counts tp rank 0's shards only)."""
    from megarl.utils.dist import run_multiprocess

    skip, init = run_multiprocess(_tp_attributes, 2, str(tiny_llama_dir), timeout_s=300)[1]
    assert skip == init and sum(v[0] is True for v in init.values()) == 10, (skip, init)  # embed, output, 4 per layer


def _tp_attributes(rank, world, model_dir):
    from megarl.models.layouts import ModelDims
    from megarl.trainer.local import set_tp_attributes
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(2, 1)
    dims = ModelDims.from_hf_config(read_hf_config(model_dir))
    out = []
    for init_weights in (False, True):
        model = build_gpt_model(dims, init_weights=init_weights)
        if not init_weights:
            set_tp_attributes(model)
        out.append({n: tuple(getattr(p, a, None) for a in ("tensor_model_parallel", "partition_dim",
                                                             "partition_stride"))
                    for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_step_matches_single_rank(tiny_llama_dir, tmp_path, reference, layout, monkeypatch):
    batch, expected = reference
    tp, pp, dp = LAYOUTS[layout]
    # Placement reaches each rank before CUDA starts, as the ordinal's entry of our own CUDA_VISIBLE_DEVICES
    # (a job given GPUs 10-15 puts ordinal 4 on GPU 14); ids past any device here: no CUDA either way
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "10,11,12,13,14,15")
    with _executor(tiny_llama_dir, tmp_path, (tp, pp, dp), devices=[4, 5]) as ex:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        pids = ex.pids
        health = ex.health()
        assert [h["cuda_visible_devices"] for h in health] == ["14", "15"]
        assert [{k: h[k] for k in ("rank", "tp", "pp", "dp", "pid")} for h in health] == [
            {"rank": r, **rank_coords(r, tp, pp, dp), "pid": pids[r]} for r in range(2)]
        assert [h["cores"] for h in health] == ([[0], [1]] if CPUS else [[], []])
        assert ex.step_count == 0
        got = [ex.step(batch) for _ in range(2)]
        assert ex.step_count == 2
    assert not any(_alive(p) for p in pids)
    for step, (g, e) in enumerate(zip(got, expected), 1):
        assert set(g) == set(e), (step, set(g) ^ set(e))
        # DP2 ranks each split their half into micro-batches: the same rows per micro-batch
        assert g["micro_batches"] == e["micro_batches"] // dp
        for k, v in e.items():
            if k in EXACT:
                assert g[k] == v, (step, k, g[k], v)
            elif not k.endswith("_s") and k != "micro_batches":  # *_s: timings
                assert math.isclose(g[k], v, rel_tol=RTOL, abs_tol=ATOL), (step, k, g[k], v)
        assert g["grad_norm"] > 0 and g["tokens"] == batch.num_loss_tokens


def test_killed_rank_stops_the_next_command_naming_it(tiny_llama_dir, tmp_path, reference):
    batch, _ = reference
    with _executor(tiny_llama_dir, tmp_path, (2, 1, 1), step_timeout_s=60) as ex:
        ex.step(batch)
        pids = ex.pids
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TrainerRankFailed) as err:
            ex.step(batch)
        took = time.monotonic() - t0
        with pytest.raises(TrainerRankFailed):  # the executor stays failed
            ex.save()
    msg = str(err.value)
    assert "trainer rank 1 (tp 1, pp 0, dp 0" in msg and f"pid {pids[1]}" in msg and "SIGKILL" in msg, msg
    assert (err.value.rank, err.value.tp, err.value.exitcode) == (1, 1, -signal.SIGKILL)
    assert took < 60, took
    assert not any(_alive(p) for p in pids)


def test_frozen_rank_stops_the_job_by_heartbeat(tiny_llama_dir, tmp_path, reference):
    """SIGSTOP: alive but silent. Its peer keeps beating while it waits in the collective, so the
    error names the frozen rank only, after heartbeat_timeout_s, long before step_timeout_s."""
    batch, _ = reference
    # 15 s: a healthy rank starved for a few seconds on a loaded machine must not look frozen too (4 s did);
    # still far below step_timeout_s, so the error can only come from the heartbeat
    with _executor(tiny_llama_dir, tmp_path, (1, 2, 1), heartbeat_timeout_s=15, step_timeout_s=120) as ex:
        pids = ex.pids
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TrainerTimeout) as err:
            ex.step(batch)
        took = time.monotonic() - t0
    assert err.value.ranks == [0], str(err.value)
    assert "trainer rank 0 (tp 0, pp 0, dp 0" in str(err.value) and "frozen" in str(err.value)
    assert 14 < took < 60, took  # its last beat up to 1 s before the SIGSTOP
    assert not any(_alive(p) for p in pids)


def test_a_batch_too_large_for_a_frozen_ranks_channel_stops_the_job(tiny_llama_dir, tmp_path):
    """SIGSTOP, then a command larger than the channel's buffer: the controller's write cannot finish
    (the rank never reads), so it is bounded by heartbeat_timeout_s as the wait is (an unbounded write
    blocked the controller for good, past every timeout)."""
    import threading

    tokens = [[7] * 2048 for _ in range(64)]  # ~4 MB pickled: far more than a socket's buffer (~200 KB)
    big = RolloutBatch.from_sequences(tokens, [[0.0] + [1.0] * 2047] * 64, advantages=[1.0] * 64,
                                      versions=[[0] * 2048] * 64)
    out = {}
    with _executor(tiny_llama_dir, tmp_path, heartbeat_timeout_s=15, step_timeout_s=120) as ex:
        pids = ex.pids
        os.kill(pids[0], signal.SIGSTOP)

        def step():
            try:
                ex.step(big)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                out["error"] = exc

        t0 = time.monotonic()
        caller = threading.Thread(target=step, daemon=True)
        caller.start()
        caller.join(90)  # the test's own bound (heartbeat 15 s + a poll): only an unbounded write gets here
        took = time.monotonic() - t0
        assert not caller.is_alive(), "the controller still writes to a frozen rank"
    assert isinstance(out.get("error"), TrainerTimeout), out
    assert "trainer rank 0" in str(out["error"]) and "frozen" in str(out["error"]), str(out["error"])
    assert "to take the 'step' command" in str(out["error"]), str(out["error"])
    assert 14 < took < 90, took
    assert not any(_alive(p) for p in pids)


def test_save_then_resume_continues_identically(tiny_llama_dir, tmp_path, reference):
    batch, _ = reference
    with _executor(tiny_llama_dir, tmp_path, (1, 1, 2)) as ex:
        ex.step(batch)
        path = ex.save()
        uninterrupted = ex.step(batch)
    assert path == tmp_path / "checkpoints" / "step_00000001" and (path / "meta.json").is_file()
    with _executor(tiny_llama_dir, tmp_path, (1, 1, 2), resume_from="auto") as ex:
        assert ex.step_count == 1
        resumed = ex.step(batch)
        assert ex.step_count == 2
    # the same layout, threads and state: the arithmetic is the same, so the numbers are equal
    for k in ("loss", "grad_norm", "lr", "loss/pg_loss", "loss/kl_ref"):
        assert resumed[k] == uninterrupted[k], (k, resumed[k], uninterrupted[k])


def test_ddma_sync_from_tp2_equals_shm_push_of_its_weights(tiny_llama_dir, tmp_path, reference):
    """After a train step, DDMA from the TP2 ranks into a TP1 fp32 engine leaves the engine
    holding bitwise what the full-tensor shm push of the executor's own (gathered) weights gives:
    the same greedy tokens and bitwise the same logprobs; and not what it started from."""
    from megarl.config import load_config
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
    from megarl.ddma.sync import SyncSpec, host_store
    from megarl.generator.executor import GeneratorExecutor
    from megarl.models.layouts import ModelDims
    from megarl.trainer.model import read_hf_config

    batch, _ = reference
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_dir}", "generator.dtype=float32", "generator.max_new_tokens=12"])
    store = host_store()
    spec = SyncSpec(ModelDims.from_hf_config(read_hf_config(tiny_llama_dir)), TrainerTopology(2, 1, 1),
                    GeneratorTopology(1, 1), "127.0.0.1", store.port, transport="zero_copy",
                    engine_dtype="float32", timeout_s=120)
    prompts, greedy = [[1, 504, 3180, 314], [1, 2683, 314, 253, 1345]], {"temperature": 0.0}

    def run(gen):
        samples = gen.generate(prompts, n_samples=1, sampling=greedy)
        return [s.completion_ids for s in samples], [torch.tensor(s.behav_logprobs) for s in samples]

    with _executor(tiny_llama_dir, tmp_path, (2, 1, 1)) as ex, GeneratorExecutor(cfg.generator, tiny_llama_dir) as gen:
        ids_a, lps_a = run(gen)
        ex.step(batch)
        ex.start_sync(spec, 1)
        gen.update_weights_from_source(spec.weight_source(1), 1)
        stats = ex.finish_sync()
        ids_ddma, lps_ddma = run(gen)
        gen.update_weights(ex.hf_weights(), version=2)
        ids_shm, lps_shm = run(gen)
    assert [(s["rank"], s["tp"]) for s in stats] == [(0, 0), (1, 1)]
    assert all(s["bytes_sent"] > 0 for s in stats)
    assert ids_ddma == ids_shm
    assert all(torch.equal(a, b) for a, b in zip(lps_ddma, lps_shm))
    # lr 1e-3 Adam moved every weight by ~1e-3: the engine's logprobs must have moved off A's
    assert any(not torch.equal(a, b) for a, b in zip(lps_a, lps_ddma))


def test_failed_start_names_the_rank_and_leaves_no_process(tiny_llama_dir, tmp_path):
    ex = _executor(tiny_llama_dir, tmp_path, (1, 2, 1), resume_from=str(tmp_path / "no_such_checkpoint"))
    with pytest.raises(TrainerRankFailed) as err:
        ex.start()
    msg = str(err.value)
    assert "raised" in msg and "CheckpointError" in msg and "no_such_checkpoint" in msg, msg
    assert f"trainer rank {err.value.rank} (tp 0, pp {err.value.pp}, dp 0" in msg
    assert ex.pids == [] and not any(_alive(p.pid) for p in ex._procs)
