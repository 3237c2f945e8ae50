"""Generator executor against transformers on tiny models: greedy tokens, behaviour logprobs,
weight updates (bf16 and FP8), partial rollouts, in-flight updates, DP replicas, TP=2, crashes.

Engines are expensive to start on 2 cores, so each module-scoped fixture starts one executor and
several tests share it (they run in file order; the crash test kills its engine last).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from megarl.generator.config import GeneratorConfig
from megarl.generator.executor import GeneratorEngineDied, GeneratorExecutor, GeneratorTimeout
from megarl.generator.shm_source import pack_to_shm
from megarl.generator.weight_source import open_weight_source
from tests.harness.generator import (BF16_FLOOR, BF16_NOISE_FACTOR, base_cfg, bf16_noise, hf_logprobs, hf_model,
                                     lp_err, perturbed)
from tests.harness.procs import alive

PROMPTS = [[1, 504, 3012, 281], [1, 9038, 17, 6124, 88], [1, 42, 4711]]

# Greedy paths: every engine token must be the fp32 argmax up to a tie within twice the bound (both
# logprobs of a top-1/top-2 pair may err); at least this fraction must be the exact argmax (the
# prompts are chosen with a top-2 gap beyond the reference's own noise, so near-ties are rare).
GREEDY_EXACT_FRAC = 0.8


def bf16_bound(model_dir, state_dict, samples, start=0, stop=None, temperature=1.0) -> float:
    """How far a bf16 engine's logprobs may be from fp32 transformers on these samples' tokens
    [start, stop) (see BF16_NOISE_FACTOR)."""
    seqs = [(s.prompt_ids + s.completion_ids[:start], s.completion_ids[start:stop]) for s in samples]
    return max(BF16_NOISE_FACTOR * bf16_noise(model_dir, state_dict, seqs, temperature), BF16_FLOOR)


@torch.no_grad()
def separated_prompts(model_dir, state_dict, count, n_tokens, seed=0) -> list[list[int]]:
    """Prompts whose fp32 greedy path keeps a top-1/top-2 logprob gap above twice transformers' own
    bf16 noise on that very path for `n_tokens` steps: greedy decoding there is decided beyond
    typical bf16 noise, so a correct bf16 engine follows it (almost always exactly; see check_greedy)."""
    model = hf_model(model_dir, state_dict)
    g = torch.Generator().manual_seed(seed)
    cands = torch.cat([torch.ones(256, 1, dtype=torch.long),
                       torch.randint(3, model.config.vocab_size, (256, 4), generator=g)], 1)
    out = model.generate(cands, max_new_tokens=n_tokens, do_sample=False, top_k=None, top_p=None,
                         temperature=None, eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    top2 = torch.stack([torch.log_softmax(l.float(), -1).topk(2).values for l in out.logits], 1)
    gap = (top2[..., 0] - top2[..., 1]).min(1).values
    ok = []
    for i in gap.argsort(descending=True).tolist()[:8 * count]:
        prompt, completion = cands[i].tolist(), out.sequences[i, cands.shape[1]:].tolist()
        if float(gap[i]) > 2 * max(bf16_noise(model_dir, state_dict, [(prompt, completion)]), BF16_FLOOR):
            ok.append(prompt)
    assert len(ok) >= count, f"only {len(ok)} prompts with a greedy margin beyond bf16 noise: model too flat"
    return ok[:count]


def check_greedy(model, sample, tol, start=0, stop=None):
    """Greedy tokens [start, stop): each is transformers' argmax given the prefix, up to ties
    within ``tol`` (twice the bf16 bound: both sides err); returns the number of exact argmax matches."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    p = len(sample.prompt_ids)
    exact = 0
    for i in range(start, len(sample.completion_ids) if stop is None else stop):
        row = lp[p + i - 1]
        tok = sample.completion_ids[i]
        assert row[tok] >= row.max() - tol, (i, tok, int(row.argmax()))  # both sides err
        exact += int(tok == int(row.argmax()))
    return exact


# ------------------------------------------------------------------ plain pieces
def test_shm_weights_round_trip():
    tensors = {"a.weight": torch.randn(3, 5), "b.bias": torch.arange(7, dtype=torch.int64)}
    shm = pack_to_shm(tensors.items(), dtype=torch.bfloat16)
    try:
        got = dict(open_weight_source(shm.source()))
        assert got["a.weight"].dtype == torch.bfloat16 and got["b.bias"].dtype == torch.int64
        torch.testing.assert_close(got["a.weight"], tensors["a.weight"].bfloat16())
        assert torch.equal(got["b.bias"], tensors["b.bias"])
    finally:
        shm.unlink()
    with pytest.raises(FileNotFoundError, match="unlinked"):
        list(open_weight_source(shm.source()))
    with pytest.raises(ValueError, match="unknown weight source"):
        list(open_weight_source({"kind": "nope"}))


def test_threads_binds_split_cores():
    from megarl.generator.executor import threads_binds

    assert threads_binds(GeneratorConfig(), cpus=[0, 1]) == ["0-1"]
    assert threads_binds(GeneratorConfig(tp=2), cpus=[0, 1]) == ["0|1"]
    assert threads_binds(GeneratorConfig(replicas=2), cpus=[0, 1]) == ["0", "1"]
    assert threads_binds(GeneratorConfig(replicas=2, tp=2), cpus=range(8)) == ["0-1|2-3", "4-5|6-7"]
    assert threads_binds(GeneratorConfig(replicas=2, tp=2), cpus=[0, 1]) == ["0|1", "0|1"]  # shared
    assert threads_binds(GeneratorConfig(replicas=2, threads_bind="0;1")) == ["0", "1"]
    with pytest.raises(ValueError, match="generator.tp=2"):
        threads_binds(GeneratorConfig(tp=2, threads_bind="0-1"))


def test_config_problems_name_the_key():
    assert GeneratorConfig().problems(on_cpu=True) == []
    probs = GeneratorConfig(quantization="fp8_per_block", top_p=0.0).problems(on_cpu=True)
    assert any("generator.quantization" in p and "GPU" in p for p in probs)
    assert any("generator.top_p" in p for p in probs)
    (fp32,) = GeneratorConfig(quantization="fp8_per_channel", dtype="float32").problems(on_cpu=True)
    assert "generator.quantization='fp8_per_channel' needs generator.dtype=bfloat16 or float16" in fp32, fp32
    assert GeneratorConfig(quantization="fp8_per_channel", dtype="bfloat16").problems(on_cpu=True) == []
    assert GeneratorConfig(temperature=0.7).trainer_logprob_temperature() == 0.7
    assert GeneratorConfig(temperature=0.7, logprobs_mode="raw").trainer_logprob_temperature() == 1.0


# ------------------------------------------------------------------ bf16, TP=1
@pytest.fixture(scope="module")
def bf16_gen(tiny_llama_dir, tmp_path_factory):
    cfg = base_cfg(log_dir=str(tmp_path_factory.mktemp("gen_bf16_logs")))
    ex = GeneratorExecutor(cfg, tiny_llama_dir).start()
    pids = ex.pids
    yield ex
    ex.shutdown()
    assert not any(alive(p) for p in pids)  # no engine process left behind


def attention_kernel(block_size: int) -> str:
    """The CPU attention kernel vLLM picks for a bf16 engine with head_dim 32 on this machine."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, block_size, 32)


def test_greedy_matches_transformers(bf16_gen, tiny_llama_dir):
    """On the default block size: the AMX kernel on AMX CPUs, the vector kernel elsewhere."""
    print(f"attention kernel (default block size): {attention_kernel(128)}")
    _check_greedy_engine(bf16_gen, tiny_llama_dir)


def test_greedy_matches_transformers_vector_kernel(tiny_llama_dir, tmp_path, monkeypatch):
    """The same check with the attention kernel forced to the vector one: on an AMX CPU the default
    test above ran the AMX kernel, so together they cover both kernels a user's CPU may pick."""
    from megarl.generator.engine import FORCE_CPU_ATTN_KERNEL_ENV

    monkeypatch.setenv(FORCE_CPU_ATTN_KERNEL_ENV, "vec")  # the replica process inherits it
    with GeneratorExecutor(base_cfg(log_dir=str(tmp_path / "logs")), tiny_llama_dir) as ex:
        _check_greedy_engine(ex, tiny_llama_dir)
    logs = "".join(f.read_text(errors="replace") for f in (tmp_path / "logs").iterdir())
    assert f"kernel forced to 'vec' (vLLM chose '{attention_kernel(128)}')" in logs


def _check_greedy_engine(gen, tiny_llama_dir):
    ref = hf_model(tiny_llama_dir)
    prompts = separated_prompts(tiny_llama_dir, None, 3, 10)
    samples = gen.generate(prompts, max_new_tokens=10)
    assert [s.prompt_ids for s in samples] == prompts
    bound = bf16_bound(tiny_llama_dir, None, samples)
    for s in samples:
        assert len(s.completion_ids) == 10 and s.finish_reason == "length"
        assert s.versions == [0] * 10
        # every token is the fp32 argmax up to a bf16-noise tie; a wrong weight breaks this by nats
        assert check_greedy(ref, s, 2 * bound) >= GREEDY_EXACT_FRAC * 10
        assert lp_err(ref, s) < bound, (lp_err(ref, s), bound)


def test_sampled_logprobs_are_tempered(bf16_gen, tiny_llama_dir):
    """Processed logprobs = log_softmax(logits / T) of the sampled tokens: the trainer's convention
    with trainer_logprob_temperature(); the untempered distribution is measurably different."""
    t = 0.8
    samples = bf16_gen.generate(PROMPTS[:2], n_samples=3, max_new_tokens=10, sampling={"temperature": t})
    ref = hf_model(tiny_llama_dir)
    assert len(samples) == 6 and [s.sample_index for s in samples[:3]] == [0, 1, 2]
    assert [s.prompt_ids for s in samples] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert len({tuple(s.completion_ids) for s in samples}) > 2  # really sampled
    bound = bf16_bound(tiny_llama_dir, None, samples, temperature=t)
    assert max(lp_err(ref, s, temperature=t) for s in samples) < bound
    # the untempered distribution is off by more than bf16 noise can explain
    assert min(lp_err(ref, s) for s in samples) > 2 * bound


def test_stop_string_ends_generation(bf16_gen):
    from transformers import AutoTokenizer

    base = bf16_gen.generate(PROMPTS[:1], max_new_tokens=12)[0]
    tok = AutoTokenizer.from_pretrained(bf16_gen.model_dir)
    piece = tok.decode(base.completion_ids[5:7])
    s = bf16_gen.generate(PROMPTS[:1], max_new_tokens=12, sampling={"stop": [piece]})[0]
    assert s.finish_reason == "stop" and s.stop_reason == piece
    assert piece in tok.decode(s.completion_ids) and len(s.completion_ids) <= 7
    assert s.completion_ids == base.completion_ids[:len(s.completion_ids)]


def test_update_follows_new_weights(bf16_gen, tiny_llama_dir):
    new = perturbed(tiny_llama_dir, seed=1)
    ref = hf_model(tiny_llama_dir, new)
    prompts = separated_prompts(tiny_llama_dir, new, 3, 10, seed=1)
    before = bf16_gen.generate(prompts, max_new_tokens=10)
    bf16_gen.update_weights(new.items())
    assert bf16_gen.version == 1 and bf16_gen.health()[0]["version"] == 1
    after = bf16_gen.generate(prompts, max_new_tokens=10)
    assert [s.completion_ids for s in after] != [s.completion_ids for s in before]
    bound = bf16_bound(tiny_llama_dir, new, after)
    for s in after:
        assert s.versions == [1] * 10
        # every token is the fp32 argmax up to a bf16-noise tie; a wrong weight breaks this by nats
        assert check_greedy(ref, s, 2 * bound) >= GREEDY_EXACT_FRAC * 10
        assert lp_err(ref, s) < bound, (lp_err(ref, s), bound)


def test_partial_rollout_resumes_under_new_policy(bf16_gen, tiny_llama_dir):
    v = bf16_gen.version
    old_sd = perturbed(tiny_llama_dir, seed=1)  # what the engine holds now (previous test)
    new_sd = perturbed(tiny_llama_dir, seed=2)
    bf16_gen.submit(PROMPTS[:2], max_new_tokens=12, round_token_budget=5)
    bf16_gen.drain()
    assert bf16_gen.num_partial == 2 and bf16_gen.poll() == []  # cut after 5 tokens, cached
    bf16_gen.update_weights(new_sd.items())  # resumes the partials at v + 1
    samples = sorted(bf16_gen.collect(), key=lambda s: s.group_id)
    old, new = hf_model(tiny_llama_dir, old_sd), hf_model(tiny_llama_dir, new_sd)
    old_bound = bf16_bound(tiny_llama_dir, old_sd, samples, stop=5)
    new_bound = bf16_bound(tiny_llama_dir, new_sd, samples, start=5)
    for s, prompt in zip(samples, PROMPTS[:2]):
        assert s.prompt_ids == prompt and s.num_rounds == 3  # 5 + 5 + 2 tokens
        assert len(s.completion_ids) == len(s.behav_logprobs) == 12  # nothing lost or duplicated
        assert s.versions == [v] * 5 + [v + 1] * 7
        # The first 5 tokens are the old policy's, the rest the new policy's given that prefix.
        assert check_greedy(old, s, 2 * old_bound, stop=5) >= GREEDY_EXACT_FRAC * 5
        assert check_greedy(new, s, 2 * new_bound, start=5) >= GREEDY_EXACT_FRAC * 7
        assert lp_err(new, s, start=5) < new_bound, (lp_err(new, s, start=5), new_bound)
        assert lp_err(old, s, stop=5) < old_bound, (lp_err(old, s, stop=5), old_bound)


def test_inflight_update_switches_mid_generation(bf16_gen, tiny_llama_dir):
    v = bf16_gen.version
    new_sd = perturbed(tiny_llama_dir, seed=3)
    tokens0 = bf16_gen.health()[0]["tokens"]
    bf16_gen.submit(PROMPTS[:1], max_new_tokens=200, sampling={"ignore_eos": True})
    deadline = time.monotonic() + 60
    while bf16_gen.health()[0]["tokens"] == tokens0:  # decoding has started
        assert time.monotonic() < deadline
    bf16_gen.update_weights(new_sd.items())  # applied between two decode steps
    s = bf16_gen.collect()[0]
    n = len(s.completion_ids)
    assert v + 1 in s.versions, "update landed after the generation finished"
    k = s.versions.index(v + 1)
    assert 0 < k < n and s.versions == [v] * k + [v + 1] * (n - k) and s.num_rounds == 1
    assert n == 200
    new = hf_model(tiny_llama_dir, new_sd)
    bound = bf16_bound(tiny_llama_dir, new_sd, [s], start=k)
    # after the switch: the new policy's continuation of the (kept) prefix
    assert check_greedy(new, s, 2 * bound, start=k) >= GREEDY_EXACT_FRAC * (n - k)
    assert lp_err(new, s, start=k) < bound, (lp_err(new, s, start=k), bound)


# ------------------------------------------------------------------ FP8, two DP replicas
@pytest.fixture(scope="module")
def fp8_gen(tiny_llama_dir, tmp_path_factory):
    cfg = base_cfg(quantization="fp8_per_channel", replicas=2,
                   log_dir=str(tmp_path_factory.mktemp("gen_fp8_logs")))
    ex = GeneratorExecutor(cfg, tiny_llama_dir).start()
    pids = ex.pids
    yield ex
    ex.shutdown()
    assert not any(alive(p) for p in pids)


# HF and vLLM share these names (vLLM fuses q/k/v and gate/up, not o_proj and down_proj).
FP8_WEIGHTS = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight")


def _fp8_error_ok(deq: torch.Tensor, ref: torch.Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: per element |err| <= 2^-4 |w| (normal range) + the per-row
    subnormal step scale * 2^-9, with scale = rowmax / 448."""
    ref = ref.float()
    scale = ref.abs().amax(dim=1, keepdim=True) / 448.0
    bound = ref.abs() * 2.0**-4 + scale * 2.0**-9 + 1e-6
    assert bool(((deq - ref).abs() <= bound).all()), float(((deq - ref).abs() / bound).max())
    assert not torch.equal(deq, ref)  # it really is quantized


FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fake_fp8(x: torch.Tensor, dim: int) -> torch.Tensor:
    scale = x.float().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / 448.0
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def hf_fp8_model(model_dir, state_dict, dtype=torch.float32):
    """transformers with vLLM's fp8_per_channel math: per-output-channel FP8 weights, dynamic
    per-token FP8 activations into every linear layer except embeddings and lm_head."""
    model = hf_model(model_dir, state_dict, dtype=dtype)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in FP8_LINEARS:
            mod.weight.data = _fake_fp8(mod.weight.data, 1)
            mod.register_forward_pre_hook(lambda m, args: (_fake_fp8(args[0], -1),))
    return model


# FP8 rounding is discontinuous: bf16-level differences upstream flip the rounding of single
# activations, so a bf16 engine with FP8 weights differs from the fp32 emulation by that flip noise.
# Its size is measured the same way as for bf16 (the emulation itself run in bf16 vs in fp32, on the
# same tokens) and the engine gets BF16_NOISE_FACTOR times it; the pre-update weights are off by
# several nats.


def test_fp8_update_requantizes_on_every_replica(fp8_gen, tiny_llama_dir):
    before = fp8_gen.generate(PROMPTS, max_new_tokens=10)
    new = perturbed(tiny_llama_dir, seed=4)
    pushed = {k: v.to(torch.bfloat16) for k, v in new.items()}
    fp8_gen.update_weights(new.items())
    for replica in (0, 1):  # both DP replicas got and re-quantized the new weights
        assert fp8_gen.health()[replica]["version"] == 1
        for name in FP8_WEIGHTS:
            (deq,) = fp8_gen.inspect_weight(name, replica=replica)
            _fp8_error_ok(deq, pushed[name])
    after = fp8_gen.generate(PROMPTS, n_samples=2, max_new_tokens=10)  # groups spread over replicas
    assert all(s.versions == [1] * 10 for s in after)
    assert [s.completion_ids for s in after[::2]] != [s.completion_ids for s in before]
    # Logprobs follow the new weights: close to transformers on them, far from the old ones.
    ref_new, ref_old = hf_fp8_model(tiny_llama_dir, new), hf_fp8_model(tiny_llama_dir, None)
    ref_new16 = hf_fp8_model(tiny_llama_dir, new, dtype=torch.bfloat16)
    noise = [(hf_logprobs(ref_new16, s.prompt_ids, s.completion_ids)
              - hf_logprobs(ref_new, s.prompt_ids, s.completion_ids)).abs() for s in after]
    bound_max = max(BF16_NOISE_FACTOR * float(torch.cat(noise).max()), BF16_FLOOR)
    bound_mean = max(BF16_NOISE_FACTOR * float(torch.cat(noise).mean()), BF16_FLOOR)
    diffs = []
    for s in after:
        lp = torch.tensor(s.behav_logprobs)
        diff_new = (lp - hf_logprobs(ref_new, s.prompt_ids, s.completion_ids)).abs()
        diff_old = (lp - hf_logprobs(ref_old, s.prompt_ids, s.completion_ids)).abs()
        diffs.append(diff_new)
        assert diff_new.max() < bound_max, (diff_new, bound_max)
        # stale weights are several nats off: 5x the fresh error separates them with room to spare
        assert diff_old.mean() > 5 * diff_new.mean(), (diff_old.mean(), diff_new.mean())
    assert float(torch.cat(diffs).mean()) < bound_mean, (float(torch.cat(diffs).mean()), bound_mean)


def test_hung_engine_times_out_then_recovers(fp8_gen):
    fp8_gen.submit(PROMPTS, n_samples=2, max_new_tokens=30)
    frozen = fp8_gen.pids[1]
    os.kill(frozen, signal.SIGSTOP)  # a hung engine: alive, silent
    try:
        t0 = time.monotonic()
        with pytest.raises(GeneratorTimeout, match="more sample"):
            fp8_gen.collect(timeout_s=3)
        assert time.monotonic() - t0 < 30
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert len(fp8_gen.collect(timeout_s=60)) == 6  # nothing lost once it resumes


def test_killed_engine_is_reported(fp8_gen):
    fp8_gen.cfg.max_restarts = 0  # supervision off: a dead replica stops the job (restarts: test_generator_faults.py)
    fp8_gen.submit(PROMPTS, n_samples=4, max_new_tokens=200)
    victim = fp8_gen.pids[1]
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(GeneratorEngineDied, match="replica 1 .*killed by signal SIGKILL"):
        fp8_gen.collect(timeout_s=60)
    assert time.monotonic() - t0 < 30
    with pytest.raises(GeneratorEngineDied):  # and it stays failed, loudly
        fp8_gen.submit(PROMPTS)


# ------------------------------------------------------------------ TP=2 (vLLM's own workers)
@pytest.mark.slow  # ~75-160 s on 2 shared cores: a third engine start, with two worker processes
def test_tp2_engine_update_matches_transformers(tiny_llama_dir, tmp_path):
    """A TP=2 engine (two vLLM worker processes, one core each) loads pushed weights shard by
    shard through the same entry point and decodes like transformers on them."""
    new = perturbed(tiny_llama_dir, seed=5)
    ref = hf_model(tiny_llama_dir, new)
    prompts = separated_prompts(tiny_llama_dir, new, 2, 8, seed=5)
    cfg = base_cfg(tp=2, log_dir=str(tmp_path / "logs"))
    with GeneratorExecutor(cfg, tiny_llama_dir) as ex:
        pids = ex.pids
        shm = ex.health()[0]  # answers between steps
        prefixes = [p for h in ex._replicas for p in h.info["shm_prefixes"]]
        assert prefixes and shm["version"] == 0
        ex.update_weights(new.items())
        samples = ex.generate(prompts, max_new_tokens=8)
    assert not any(alive(p) for p in pids)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(tuple(prefixes))]  # cleaned up
    bound = bf16_bound(tiny_llama_dir, new, samples)
    for s in samples:
        assert s.versions == [1] * 8
        assert check_greedy(ref, s, 2 * bound) >= GREEDY_EXACT_FRAC * 8
        assert lp_err(ref, s) < bound, (lp_err(ref, s), bound)


# ------------------------------------------------------------------ SmolLM2-135M (real weights)
@pytest.mark.slow  # converts/loads SmolLM2 and starts an engine on it (~1-2 min on 2 cores)
def test_smollm2_greedy_and_logprobs_match_transformers(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["What is 12 + 30?", "Name a primary color.", "Write a haiku about rain."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in questions]
    cfg = base_cfg(max_new_tokens=24, max_model_len=512, log_dir=str(tmp_path / "logs"))
    with GeneratorExecutor(cfg, smollm2_dir) as ex:
        samples = ex.generate(prompts)
    # SmolLM2's logits reach |20|, where bf16 spacing is 0.125: the bound comes from transformers'
    # own bf16 noise on these tokens (see BF16_NOISE_FACTOR), like the tiny-model tests.
    ref = hf_model(smollm2_dir)
    bound = bf16_bound(smollm2_dir, None, samples)
    for s in samples:
        assert s.finish_reason in ("stop", "length") and len(s.completion_ids) > 0
        assert check_greedy(ref, s, 2 * bound) >= 0.9 * len(s.completion_ids), tok.decode(s.completion_ids)
        assert lp_err(ref, s) < bound, (lp_err(ref, s), bound)
