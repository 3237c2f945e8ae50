"""Rollout routing replay (R3, issue 45): a bf16 vLLM engine routes some tokens of the tiny MoE to other
experts than the fp32 trainer's router would; with the engine's expert ids replayed through megatron's
RouterReplay the trainer routes exactly as the engine did (moe/routing_mismatch 0) and its logprobs
match the engine's within the bf16 bound. The disagreement is made certain, not left to bf16 rounding
(3 of 512 pairs on this machine, docs/moe.md; another CPU's kernels may flip none): experts 1 and 2 get
router rows 1e-4 apart (:func:`near_tie_moe_dir`), a tie the fp32 trainer breaks by the sign of the
token's logit and the bf16 engine cannot see.

Also: a sample's routed experts across partial-rollout rounds and the controller's saved state (JSON),
multi-turn rollouts (every turn's routing), and `megarl train` with trainer.router_replay end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from megarl.utils.dist import run_multiprocess

REPO = Path(__file__).resolve().parents[2]

from tests.harness.generator import BF16_FLOOR, BF16_NOISE_FACTOR, bf16_noise

PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 8, 56  # 16 x 63 routed token-layer pairs
TIE = 1e-4  # relative gap between the router rows of experts 1 and 2: ~1000x fp32's rounding (1.2e-7),
            # ~40x below bf16's (2^-9 = 2e-3), so bf16 rounds most elements of both rows alike


def near_tie_moe_dir(moe_dir: Path, out: Path) -> Path:
    """``moe_dir`` with the MoE router's row 2 = row 1 x (1 + TIE). Whenever experts 1 and 2 compete for
    the last top-2 slot (one of experts 0 and 3 above both, the other below: ~1/3 of tokens) the fp32
    trainer takes expert 2 exactly when the token's logit for expert 1 is positive, while the engine's
    bf16 rows are (nearly) equal and its choice depends on rounding: a disagreement on about half of
    those, ~1/6 of all pairs, on any CPU."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(moe_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    gate = weights["model.layers.0.mlp.gate.weight"]
    gate[2] = gate[1] * (1 + TIE)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _engine_main(hf_dir: str, out: str) -> None:
    """In a fresh process: a bf16 engine, one request at a time with its whole prompt in one prefill
    (the capture's row order, megarl/generator/routed_experts.py), each request's routed experts and
    sampled tokens with their logprobs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from megarl.generator.routed_experts import install_capture, take_captured

    llm = LLM(model=hf_dir, dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0, max_num_seqs=1,
              enable_prefix_caching=False, max_num_batched_tokens=2048)
    assert llm.collective_rpc(install_capture) == [1]  # one MoE layer (layer 1 is dense)
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(PROMPTS):
        prompt = torch.randint(3, 49152, (PROMPT_LEN,), generator=g).tolist()
        sp = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True, temperature=1.0, seed=i)
        comp = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
        ids = list(comp.token_ids)
        experts = llm.collective_rpc(take_captured)[0]
        rows.append({"prompt": prompt, "completion": ids, "experts": experts.tolist(),
                     "logprobs": [float(d[t].logprob) for t, d in zip(ids, comp.logprobs)]})
    Path(out).write_text(json.dumps(rows))


def _engine_rollouts(hf_dir, tmp_path) -> list[dict]:
    out = tmp_path / "engine.json"
    code = (f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(REPO)!r}]; "
            f"from test_router_replay import _engine_main; _engine_main({str(hf_dir)!r}, {str(out)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=900)
    return json.loads(out.read_text())


def _trainer_worker(rank, world, hf_dir, tokens, experts):
    """The trainer's own plumbing: the batch carries the engine's ids (RolloutBatch.routed_experts),
    RouterStats hangs the replayer on the model, run_pipeline feeds each micro-batch's ids (4 rows
    of 16 per micro-batch; padded, then packed)."""
    import dataclasses

    from megarl.batch import RolloutBatch
    from megarl.models.layouts import ModelDims
    from megarl.trainer.convert import load_pretrained
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.router_stats import RouterStats
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(1, 1, seed=11, ep=1)
    model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)), init_weights=False)
    load_pretrained(model, hf_dir)
    replayer = RouterStats(model, replay=False).replayer
    batch = RolloutBatch.from_sequences(tokens, [[0.0] + [1.0] * (len(t) - 1) for t in tokens])
    batch.routed_experts = experts
    out = {}
    for replay in (False, True):
        replayer.replay = replay
        replayer.compared = replayer.mismatched = 0
        lp = compute_logprobs(model, batch, micro_batch_size=4).logprobs
        m = replayer.metrics()
        lp_packed = compute_logprobs(model, batch, micro_batch_size=4, packing=True).logprobs
        out[replay] = (lp, m, lp_packed, replayer.metrics())
    # rows cut to 64, 40, 24, 16 tokens (causal: the kept tokens route as before): packing puts the 40- and
    # the 24-token rows in one packed row (the 24 at offset 40), so the packed ids must follow the offsets
    keep = [(64, 40, 24, 16)[i % 4] for i in range(len(tokens))]
    cut = RolloutBatch.from_sequences([t[:k] for t, k in zip(tokens, keep)], [[0.0] + [1.0] * (k - 1) for k in keep])
    cut.routed_experts = experts[:, :max(keep)].clone()
    for i, k in enumerate(keep):
        cut.routed_experts[i, k:] = -1
    out_cut = {}
    for replay in (False, True):
        replayer.replay = replay
        padded = compute_logprobs(model, cut, micro_batch_size=4).logprobs
        m = replayer.metrics()
        out_cut[replay] = (padded, m, compute_logprobs(model, cut, micro_batch_size=4, packing=True).logprobs,
                           replayer.metrics())
    # no ids in the batch: own routing, nothing counted
    plain = compute_logprobs(model, dataclasses.replace(batch, routed_experts=None), micro_batch_size=4).logprobs
    return out, out_cut, plain, replayer.metrics()


def test_replay_routes_like_the_bf16_engine_and_matches_its_logprobs(tiny_qwen3_moe_dir, tmp_path):
    moe_dir = near_tie_moe_dir(tiny_qwen3_moe_dir, tmp_path / "near_tie")
    rollouts = _engine_rollouts(moe_dir, tmp_path)
    tokens = [r["prompt"] + r["completion"] for r in rollouts]
    s = max(len(t) for t in tokens)
    experts = torch.full((len(tokens), s, 1, 2), -1, dtype=torch.long)  # -1: the engine never routed it
    for i, r in enumerate(rollouts):
        e = torch.tensor(r["experts"])
        # the engine routed the prompt and every sampled token it fed back: all but the last token
        assert e.shape == (len(tokens[i]) - 1, 1, 2), e.shape
        assert int(e.min()) >= 0 and int(e.max()) < 4
        experts[i, :e.shape[0]] = e
    out, out_cut, plain, m_plain = run_multiprocess(_trainer_worker, 1, str(moe_dir), tokens, experts,
                                                    timeout_s=900)[0]
    (lp_own, m_own, lpp_own, mp_own), (lp_rep, m_rep, lpp_rep, mp_rep) = out[False], out[True]
    assert m_plain == {}
    # packed micro-batches carry the ids in their packed layout: the same pairs compared, the same routing
    for lp, m, lpp, mp in (out[False], out[True], out_cut[False], out_cut[True]):
        assert mp == m, (mp, m)
        assert float((lpp - lp).abs().max()) < 1e-4, float((lpp - lp).abs().max())
    assert out_cut[True][1] == {"moe/routing_mismatch": 0.0}
    known = int((experts[..., 0, 0] >= 0).sum())  # token-layer pairs compared (one MoE layer)
    # without replay the fp32 trainer routes many tokens elsewhere than the bf16 engine: ~1/6 by the near tie
    # (near_tie_moe_dir), plus rounding's own flips (0.6% here); at most the third whose last slot is contested
    # and those few: 0.02 (20 pairs) leaves a factor 8 below the expected 1/6, 0.45 a margin above 1/3 + 0.6%
    assert 0.02 < m_own["moe/routing_mismatch"] < 0.45, m_own
    assert m_own["moe/routing_mismatch"] * known == round(m_own["moe/routing_mismatch"] * known)  # a count of pairs
    assert m_rep == {"moe/routing_mismatch": 0.0}
    assert torch.equal(plain, lp_own)  # counting alone changes nothing in the forward
    # the bf16 bound (tests/harness/generator.py): BF16_NOISE_FACTOR x transformers' own bf16-vs-fp32 noise on
    # these very tokens, floored at one bf16 ulp at logprob scale 1; measured on the model without the near tie,
    # whose bf16 forward would flip routes and count the flips as noise
    seqs = [(r["prompt"], r["completion"]) for r in rollouts]
    bound = max(BF16_NOISE_FACTOR * bf16_noise(tiny_qwen3_moe_dir, None, seqs), BF16_FLOOR)
    gap_rep = gap_own = 0.0
    for i, r in enumerate(rollouts):
        p, n = len(r["prompt"]), len(r["completion"])
        eng = torch.tensor(r["logprobs"])
        gap_rep = max(gap_rep, float((lp_rep[i, p:p + n] - eng).abs().max()))
        gap_own = max(gap_own, float((lp_own[i, p:p + n] - eng).abs().max()))
    print(f"routing mismatch {m_own['moe/routing_mismatch']:.4f} of {known} pairs; max |trainer - engine| "
          f"logprob: own routing {gap_own:.4f}, replayed {gap_rep:.4f}; bf16 bound {bound:.4f}")
    assert gap_rep < bound, (gap_rep, bound)
    # The bound above holds HF's own bf16 route flips (its max over tokens is one), so it tells little apart;
    # this does: a flipped token swaps expert 1's FFN for expert 2's (same router row, independent random
    # weights: a change of the order of the expert's whole output, ~1 nat here), a replayed one differs by
    # bf16 rounding alone (relative 2^-8 of the same output): a factor 4 sits far from both
    assert gap_rep < gap_own / 4, (gap_rep, gap_own)
    assert not torch.equal(lp_rep, lp_own)  # the replay changed the forward where routing differed


def test_partial_rounds_merge_and_survive_the_saved_state():
    """A sample generated over two rounds (the second's request re-runs prompt + first-round tokens,
    part of it served by the prefix cache: -1 there) keeps, per token, the latest round that ran it;
    the Track goes through the controller's JSON state (GeneratorExecutor.snapshot/restore are the
    Track's dataclass fields) and the finished Sample's ids through dataclasses.asdict/Sample(**row)."""
    import dataclasses

    from megarl.batch import RolloutBatch
    from megarl.generator.replicas import Track
    from megarl.rollout import Sample, merge_rounds

    t = Track(key="g0s0", group_id=0, sample_index=0, prompt_index=0, prompt_ids=[5, 6, 7], max_new_tokens=6)
    # round 1: prompt (3) + 3 sampled tokens; the engine ran positions 0..4 (not the last sampled token)
    t.ids += [8, 9, 10]
    t.lps += [-1.0] * 3
    t.vers += [0] * 3
    r1 = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]], [[0, 2]], [[-1, -1]]], dtype=np.int16)
    t.experts = merge_rounds(t.experts, r1, len(t.prompt_ids) + len(t.ids))
    assert t.experts[5] == [[-1, -1]]
    # resumed after an update: positions 0-1 from the prefix cache (-1), 2..7 recomputed / new
    state = json.loads(json.dumps(dataclasses.asdict(t)))  # the controller's saved state, and back
    t = Track(**state)
    t.ids += [11, 12, 13]
    t.lps += [-1.0] * 3
    t.vers += [1] * 3
    r2 = np.array([[[-1, -1]], [[-1, -1]], [[1, 3]], [[3, 0]], [[0, 2]], [[2, 1]], [[1, 0]], [[0, 3]]], dtype=np.int16)
    t.experts = merge_rounds(t.experts, r2, len(t.prompt_ids) + len(t.ids))
    s = t.sample("length", None)
    assert s.routed_experts == [[[0, 1]], [[1, 2]], [[1, 3]], [[3, 0]], [[0, 2]], [[2, 1]], [[1, 0]], [[0, 3]],
                                [[-1, -1]]]
    back = Sample(**json.loads(json.dumps(dataclasses.asdict(s))))  # RolloutQueue.state_dict's "finished"
    assert back.routed_experts == s.routed_experts
    batch = RolloutBatch.from_samples([back, Sample([1], [2], [0.0], [0], "stop")])
    assert batch.routed_experts.shape == (2, 9, 1, 2)
    assert batch.routed_experts[0, 2].tolist() == [[1, 3]] and bool((batch.routed_experts[1] == -1).all())
    assert batch.select(slice(1, 2)).routed_experts.shape == (1, 2, 1, 2)


def test_generator_returns_each_tokens_routing_prefix_cache_hits_included(tiny_qwen3_moe_dir, tmp_path):
    """The megarl generator (a replica process, prefix cache on) returns every sample's routing for
    each token but the last, mixed batches included (3 samples of a prompt decode together). A
    300-token prompt is more than 2 of vLLM-CPU's 128-token KV blocks: asked again, its first 256
    tokens are prefix-cache hits that run no forward, and their routing is the blocks' recorded one,
    the same as the first time (fp32 engine: the same tokens route alike)."""
    from megarl.generator.executor import GeneratorExecutor
    from tests.harness.generator import base_cfg

    cfg = base_cfg(temperature=1.0, n_samples=3, max_new_tokens=24, max_model_len=512, dtype="float32",
                   log_dir=str(tmp_path / "logs"))
    prompt = torch.randint(3, 49152, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    with GeneratorExecutor(cfg, tiny_qwen3_moe_dir) as ex:
        first = ex.generate([prompt])
        again = ex.generate([prompt])
    ref = np.array(first[0].routed_experts)[:len(prompt)]
    for s in first + again:
        e = np.array(s.routed_experts)
        assert e.shape == (len(s.token_ids), 1, 2), e.shape
        assert (e[:-1] >= 0).all() and (e[:-1] < 4).all(), np.argwhere(e[:-1, 0, 0] < 0).ravel()[:10]
        assert (e[-1] == -1).all()  # the last sampled token never ran through the model
        assert np.array_equal(e[:len(prompt)], ref)


class _ThreeTurns:
    """An environment that answers each of the first two replies with the same observation tokens and
    ends after the third with reward 1: every rollout that ends its replies takes three turns."""

    name = "three-turns"
    OBSERVATION = [28, 339, 1201, 2, 44, 9]

    def reset(self, task):
        from megarl.reward.environment import EnvState

        return EnvState(task, [])

    def step(self, state, reply_ids):
        from megarl.reward.environment import StepResult

        state.turn += 1
        if state.turn >= 3:
            return StepResult(None, True, 1.0, {"correct": True})
        return StepResult(list(self.OBSERVATION), False)


def test_multi_turn_rollouts_carry_every_turns_routing(tiny_qwen3_moe_dir, tmp_path):
    """A three-turn rollout's routed experts cover every token but the last (prompt, replies and
    observations: each turn's request runs the context again), and they are the routing of the whole
    rollout run as one prompt (an independent forward: ~60 tokens fill no 128-token KV block, so no
    prefix-cache hit). fp32 engine: the same tokens route alike up to near-ties under other batch shapes
    (the generator test above finds none in 1,800 token-layer pairs), so >= 98% must agree; the same
    ids one position off agree on ~1/6 (a random top-2 of 4), and a merge that drops later turns
    leaves their tokens -1."""
    from megarl.controller.turns import multi_turn
    from megarl.data.tasks import Task
    from megarl.generator.executor import GeneratorExecutor
    from tests.harness.generator import base_cfg

    cfg = base_cfg(temperature=1.0, max_new_tokens=16, max_model_len=256, dtype="float32",
                   log_dir=str(tmp_path / "logs"))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (40,), generator=g).tolist() for _ in range(4)]
    tasks = [Task(f"q{i}", "1") for i in range(4)]
    stop = {"stop": ["e", "a", "o", "i"]}  # a random model's replies end within a few tokens (test_multi_turn)
    with GeneratorExecutor(cfg, tiny_qwen3_moe_dir) as ex:
        samples = multi_turn(ex, _ThreeTurns(), tasks, prompts, max_turns=3, max_new_tokens=16, max_model_len=256,
                             sampling=stop)
        whole = ex.generate([s.token_ids for s in samples], n_samples=1, max_new_tokens=1)
    agree = shifted = pairs = 0
    for s, ref in zip(samples, whole):
        assert s.turns == 3 and s.finish_reason == "stop", (s.turns, s.finish_reason)
        e, r = np.array(s.routed_experts), np.array(ref.routed_experts)[:len(s.token_ids)]
        assert e.shape == (len(s.token_ids), 1, 2), e.shape
        assert (e[:-1] >= 0).all(), np.argwhere(e[:-1, 0, 0] < 0).ravel()  # every turn's tokens routed
        assert (e[-1] == -1).all()  # the last sampled token never ran
        same = lambda a, b: (np.sort(a, -1) == np.sort(b, -1)).all(-1)  # noqa: E731 - a top-k set per pair
        agree += int(same(e[:-1], r[:-1]).sum())
        shifted += int(same(e[1:-1], r[:-2]).sum())
        pairs += e[:-1].shape[0] * e.shape[1]
    print(f"multi-turn routing vs the whole rollout as one prompt: {agree}/{pairs} pairs agree "
          f"({shifted} one position off)")
    assert agree >= 0.98 * pairs, (agree, pairs)
    assert shifted < 0.6 * pairs, (shifted, pairs)


def _train_rows(model_dir, out_dir, *overrides):
    from tests.harness.controller import _rows, _train

    out = _train(model_dir, out_dir, "generator.dtype=bfloat16", "controller.steps=2", "controller.eval_every=0",
                 "controller.prompts_per_step=8", "generator.max_new_tokens=64", "generator.round_token_budget=24",
                 "trainer.micro_batch_size=4", *overrides)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return _rows(out_dir / "tiny-test")


def test_train_with_router_replay_routes_like_the_engine(tiny_qwen3_moe_dir, tmp_path):
    """`megarl train` of the tiny MoE, bf16 engine and fp32 trainer, 16 samples of up to 64 tokens a
    step generated in rounds of 24 (partial rollouts: every sample's routing merged over its rounds),
    packed micro-batches of 4: without replay the trainer routes a few token-layer pairs elsewhere
    (moe/routing_mismatch > 0, and small: a mis-filed request or position would make it tens of
    percent); with trainer.router_replay=true it is 0 at every step."""
    own = _train_rows(tiny_qwen3_moe_dir, tmp_path / "own")
    rep = _train_rows(tiny_qwen3_moe_dir, tmp_path / "rep", "trainer.router_replay=true")
    m_own = [r["train/moe/routing_mismatch"] for r in own if r["step"] > 0]
    m_rep = [r["train/moe/routing_mismatch"] for r in rep if r["step"] > 0]
    print(f"moe/routing_mismatch per step: own routing {m_own}, replayed {m_rep}; "
          f"loss/mismatch own {[r['train/loss/mismatch'] for r in own]}, replayed {[r['train/loss/mismatch'] for r in rep]}")
    assert len(m_own) == len(m_rep) == 2
    assert m_rep == [0.0, 0.0]
    assert max(m_own) > 0 and max(m_own) < 0.05, m_own


def test_routing_survives_a_resume(tiny_qwen3_moe_dir, tmp_path):
    """max_policy_lag=1, partial rollouts, a checkpoint every step: the step-1 checkpoint holds step 2's
    finished samples and the step-2 one its partial rollouts, each with its routing (the controller's
    JSON state). Resumed from step 1, step 2 trains the saved samples with their saved routing:
    loss/mismatch bit-identical to the straight run, routing mismatch 0; resumed from step 2, the
    partial rollouts finish and step 3 replays them (0)."""
    from tests.harness.controller import _rows

    common = ("controller.max_policy_lag=1", "trainer.router_replay=true", "trainer.keep_checkpoints=5",
              "controller.steps=3")
    straight = _train_rows(tiny_qwen3_moe_dir, tmp_path / "a", *common)
    ckpts = tmp_path / "a" / "tiny-test" / "checkpoints"
    held = {}
    for step in (1, 2):
        rollouts = json.loads((ckpts / f"step_{step:08d}" / "controller_state.json").read_text())["rollouts"]
        finished = [s for g in rollouts["finished"].values() for s in g]
        held[step] = (sum(bool(s["routed_experts"]) for s in finished), len(finished),
                      sum(bool(t["experts"]) for t in rollouts["unfinished"]), len(rollouts["unfinished"]))
    print(f"saved (finished with routing, finished, unfinished with routing, unfinished): {held}")
    assert held[1][0] == held[1][1] > 0 and held[2][2] == held[2][3] > 0, held
    from_1 = _train_rows(tiny_qwen3_moe_dir, tmp_path / "b", *common, f"trainer.resume_from={ckpts / 'step_00000001'}")
    from_2 = _train_rows(tiny_qwen3_moe_dir, tmp_path / "c", *common, f"trainer.resume_from={ckpts / 'step_00000002'}")
    by_step = {r["step"]: r for r in straight}
    assert [r["step"] for r in from_1] == [2, 3] and [r["step"] for r in from_2] == [3]
    assert from_1[0]["train/loss/mismatch"] == by_step[2]["train/loss/mismatch"]
    for r in straight + from_1 + from_2:
        assert r["train/moe/routing_mismatch"] == 0.0, r


def test_router_replay_is_refused_for_a_dense_model_only():
    from megarl.trainer.config import TrainerConfig, router_replay_problems

    assert router_replay_problems(True, False, "llama") and not router_replay_problems(True, True, "qwen3_moe")
    assert not router_replay_problems(False, False, "llama")
    # any layout: pipeline stages replay their own layers (tests/e2e/test_router_replay_pp.py)
    assert TrainerConfig(router_replay=True, pp=2, recompute="full").problems() == []


def test_config_validation_refuses_router_replay_for_a_dense_model(tiny_llama_dir, tiny_qwen3_moe_dir):
    """Found before anything starts (megarl/config/validate.py), naming the knob and what to set."""
    import pytest

    from megarl.config import ConfigError, load_config

    cfg = REPO / "configs" / "tiny_test.yaml"
    with pytest.raises(ConfigError, match=r"trainer.router_replay=true but the model has no experts .*'llama'"):
        load_config(cfg, [f"model.path={tiny_llama_dir}", "trainer.router_replay=true"])
    assert load_config(cfg, [f"model.path={tiny_qwen3_moe_dir}", "trainer.router_replay=true"]).trainer.router_replay
