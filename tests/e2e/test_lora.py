"""LoRA on the Megatron trainer (megarl/trainer/lora.py): B=0 is the base model bit for bit, TP=2 equals
TP=1, the merged shard weights equal the adapter forward, a step moves only the adapters, the counts are
the hand counts, the generator after a DDMA sync gives the trainer's logprobs, and checkpoints keep the
adapters."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.utils.dist import run_multiprocess

REPO = Path(__file__).resolve().parents[2]
RANK, ALPHA = 4, 8.0
# fp32 logprobs of the same math in another summation order (TP shards, merged vs factored): a 128-term
# logit dot with sum|terms| ~10 rounds by <= 128 * 2^-24 * 10 ~ 8e-5 (tests/e2e/test_trainer_model.py's bound)
FP32_BOUND = 1e-4


def _batch(vocab: int, advantages=(1.0, -1.0, 1.0, -1.0)) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [10, 7, 12, 9]
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 4 + [1.0] * (n - 4) for n in lengths]
    # AIPO with behaviour logprobs far below pi: loss -rho * A * log pi, varying advantages: a nonzero gradient
    behav = [[-50.0] * n for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks, behav_logprobs=behav, advantages=list(advantages),
                                       versions=[[0] * n for n in lengths])


def _full_b(name: str, mod, tp: int) -> torch.Tensor:
    """A nonzero full (TP=1) B for linear ``name``, the same at every TP size."""
    out_full = mod.weight.shape[0] * (tp if mod.megarl_lora_column else 1)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(out_full, RANK, generator=g) * 0.5


def _set_nonzero_b(model, tp: int) -> None:
    from megarl.trainer.lora import lora_modules, set_full_adapter

    for name, mod in lora_modules(model).items():
        set_full_adapter(mod, "lora_B", _full_b(name, mod, tp))


def _forward_worker(rank, world, hf_dir, batch, tps):
    from megarl.models.layouts import ModelDims
    from megarl.trainer.config import LORA_TARGETS
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.lora import apply_lora, lora_modules, merged_delta, param_counts
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.utils.dist import init_model_parallel

    out = {}
    for tp in tps:
        init_model_parallel(tp, 1, seed=1)
        model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)))
        load_hf_into_model(model, hf_dir)
        lp = lambda: compute_logprobs(model, batch, micro_batch_size=2, temperature=1.0).logprobs  # noqa: E731
        r = {"base": lp(), "base_counts": param_counts(model)}
        r["adapted"] = apply_lora(model, RANK, ALPHA, LORA_TARGETS, seed=7)
        r["b0"] = lp()
        _set_nonzero_b(model, tp)
        r["lora"], r["counts"] = lp(), param_counts(model)
        with torch.no_grad():  # each rank merges its own shards (what the DDMA sender sends), B back to 0
            for mod in lora_modules(model).values():
                mod.weight.add_(merged_delta(mod))
                mod.lora_B.zero_()
        r["merged"] = lp()
        out[tp] = r
    return out


def _hand_counts(hf_dir) -> tuple[int, int]:
    """(HF model's parameter count, LoRA adapter count) from config.json by hand."""
    import json

    c = json.loads((Path(hf_dir) / "config.json").read_text())
    h, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    # A [r, in] + B [out, r] per linear: qkv (h -> q+2kv), proj (q -> h), fc1 (h -> 2f), fc2 (f -> h)
    adapters = layers * RANK * ((h + q + 2 * kv) + (q + h) + (h + 2 * f) + (f + h))
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * f + f * h + 2 * h  # + the two norms
    embed = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    return layers * per_layer + embed + h, adapters  # + the final norm


def test_lora_forward_b0_exact_tp2_equals_tp1_merge_matches(tiny_llama_tied_dir):
    batch = _batch(49152)
    res = run_multiprocess(_forward_worker, 2, str(tiny_llama_tied_dir), batch, [2, 1], timeout_s=600)
    tp2, tp1 = res[0][2], res[0][1]  # TP=1 on 2 ranks: DP=2 (each holds the whole model)
    for r in (tp1, tp2):
        assert r["adapted"] == 2 * 4  # 2 layers x (qkv, proj, fc1, fc2)
        assert torch.equal(r["b0"], r["base"])  # B = 0: the base model bit for bit
        assert (r["lora"] - r["base"]).abs().max() > 0.05  # B != 0 moves the logprobs (break: B ignored)
        # the merged shards (W + scale B A per rank, no gather) give the adapter forward's logprobs
        assert (r["merged"] - r["lora"]).abs().max() < FP32_BOUND
    assert (tp2["lora"] - tp1["lora"]).abs().max() < FP32_BOUND
    assert (tp2["base"] - tp1["base"]).abs().max() < FP32_BOUND
    hf_params, adapters = _hand_counts(tiny_llama_tied_dir)
    for r in (tp1, tp2):
        assert r["base_counts"] == {"model/params": hf_params, "train/trainable_params": hf_params}
        assert r["counts"] == {"model/params": hf_params + adapters, "train/trainable_params": adapters}


def _train_worker(rank, world, hf_dir, batch, tp, steps):
    from megarl.models.layouts import ModelDims
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.lora import lora_modules
    from megarl.trainer.model import build_gpt_model, read_hf_config, unwrap
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    cfg = TrainerConfig(tp=tp, dp=world // tp, lr=1e-3, grad_clip=1.0, use_distributed_optimizer=True,
                        lora_rank=RANK, lora_alpha=ALPHA)
    init_model_parallel(tp, 1, seed=1)
    model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)))
    load_hf_into_model(model, hf_dir)
    objs = build_training(cfg, model, total_steps=steps)
    m = unwrap(objs.model[0])
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    trainable = sorted(n for n, p in m.named_parameters() if p.requires_grad)
    in_optimizer = sum(p.numel() for g in objs.optimizer.param_groups for p in g["params"])
    metrics = [train_step(objs, batch, loss_name="aipo", loss_params={"rho": 4.0}, micro_batch_size=1,
                          current_version=0) for _ in range(steps)]
    after = dict(m.named_parameters())
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    return {"trainable": trainable, "changed": changed, "metrics": metrics, "in_optimizer": in_optimizer,
            "adapters": sorted(f"{n}.{k}" for n in lora_modules(m) for k in ("lora_A", "lora_B")),
            "names": sorted(before)}


def test_a_step_trains_only_the_adapters(tiny_llama_tied_dir):
    batch = _batch(49152)
    (r0, r1) = run_multiprocess(_train_worker, 2, str(tiny_llama_tied_dir), batch, 2, 2, timeout_s=600)
    hf_params, adapters = _hand_counts(tiny_llama_tied_dir)
    for r in (r0, r1):
        assert r["trainable"] == r["adapters"] and len(r["adapters"]) == 16
        # step 1 moves B (dA = B^T ... = 0 at B = 0), step 2 both; the base weights bit for bit unchanged
        assert r["changed"] == r["adapters"], sorted(set(r["names"]) - set(r["changed"]))[:5]
        assert r["metrics"][0]["grad_norm"] > 0  # the reference is not 0: a training effect to see
        assert r["metrics"][-1]["trainable_params"] == adapters
        assert r["metrics"][-1]["model/params"] == hf_params + adapters
    # the DistributedOptimizer holds adapter elements only: its dp shard of this TP rank's adapter elements
    assert r0["in_optimizer"] < adapters


# ---------------------------------------------------------------- in-process trainer: sync, checkpoint

@pytest.fixture(scope="module")
def lora_trainer(tiny_llama_tied_dir, tmp_path_factory):
    from megarl.config import load_config
    from megarl.trainer.local import LocalTrainer

    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_tied_dir}", "generator.dtype=float32", "generator.max_new_tokens=12",
        "sync.probe_every=1", "cluster.device=cpu", f"trainer.lora_rank={RANK}", f"trainer.lora_alpha={ALPHA}",
        "trainer.resume_from=null"])
    run = tmp_path_factory.mktemp("lora_run")
    trainer = LocalTrainer(cfg.trainer, cfg.algorithm, tiny_llama_tied_dir, total_steps=1, run_dir=run)
    yield cfg, trainer
    trainer.close()  # torch.distributed must not leak into the next test module


@pytest.fixture(scope="module")
def lora_gen(lora_trainer, tiny_llama_tied_dir, tmp_path_factory):
    from megarl.generator.executor import GeneratorExecutor

    cfg, _ = lora_trainer
    logs = tmp_path_factory.mktemp("lora_gen_logs")
    with GeneratorExecutor(cfg.generator, tiny_llama_tied_dir, log_dir=str(logs)) as gen:
        gen.megarl_test_logs = logs
        yield gen


def test_generator_after_ddma_sync_gives_the_merged_model_logprobs(lora_trainer, lora_gen, tiny_llama_tied_dir):
    from megarl.controller.loop import model_dims, resolved_sync
    from megarl.controller.weight_sync import WeightSync
    from megarl.trainer.logprobs import compute_logprobs

    cfg, trainer = lora_trainer
    gen = lora_gen
    _set_nonzero_b(trainer.model, 1)
    sync = WeightSync(resolved_sync(cfg), trainer, gen, dims=model_dims(tiny_llama_tied_dir),
                      generator_cfg=cfg.generator, probe_prompt=[1, 504, 3180, 314])
    m = sync.push(1)
    assert m["sync/probe_gap"] < 1e-3  # the fp32 probe bound (controller/weight_sync.py docstring)
    samples = gen.generate([[1, 504, 3180, 314], [1, 2683, 314, 253, 1345]], n_samples=2)
    batch = RolloutBatch.from_samples(samples)
    lp = compute_logprobs(trainer.model, batch, temperature=1.0).logprobs
    assert float(((lp - batch.behav_logprobs).abs() * batch.loss_mask).max()) < 1e-3
    # the base alone (what a sync without the merge sends) is far from the adapted policy
    from megarl.trainer.lora import lora_modules

    saved = {n: mod.lora_B.detach().clone() for n, mod in lora_modules(trainer.model).items()}
    with torch.no_grad():
        for mod in lora_modules(trainer.model).values():
            mod.lora_B.zero_()
    base = compute_logprobs(trainer.model, batch, temperature=1.0).logprobs
    with torch.no_grad():
        for n, mod in lora_modules(trainer.model).items():
            mod.lora_B.copy_(saved[n])
    assert float(((base - batch.behav_logprobs).abs() * batch.loss_mask).max()) > 0.05


def _greedy(gen, prompts):
    samples = gen.generate(prompts, n_samples=1, max_new_tokens=12, sampling={"temperature": 0.0})
    return RolloutBatch.from_samples(samples)


def test_later_syncs_send_only_the_merged_targets_and_land_what_a_full_sync_lands(lora_trainer, lora_gen,
                                                                                  tiny_llama_tied_dir):
    """Sync 1 sends every tensor; sync 2 (B changed) sends only the merged targets (bytes by hand), the
    frozen tensors stay as the engine holds them, and the engine computes what a full merged sync of the same
    weights gives (a sync to the replica alone, a new sender: full), bit for bit."""
    import json

    from megarl.controller.loop import model_dims, resolved_sync
    from megarl.controller.weight_sync import WeightSync
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.lora import lora_modules

    cfg, trainer = lora_trainer
    gen = lora_gen
    _set_nonzero_b(trainer.model, 1)
    sync = WeightSync(resolved_sync(cfg), trainer, gen, dims=model_dims(tiny_llama_tied_dir),
                      generator_cfg=cfg.generator, probe_prompt=[1, 504, 3180, 314])
    c = json.loads((Path(tiny_llama_tied_dir) / "config.json").read_text())
    h, f, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    hf_params, _ = _hand_counts(tiny_llama_tied_dir)
    targets = c["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * f)  # qkv, o, gate+up, down weights
    first = sync.push(1)
    assert first["sync/bytes_sent"] == hf_params * 4  # fp32 engine: every HF element once (break: skip at sync 1)
    with torch.no_grad():  # a step's change: every B moves
        for mod in lora_modules(trainer.model).values():
            mod.lora_B.mul_(-1.5)
    second = sync.push(2)
    # the layers sync 2 left out are not reported as failed loads (break: no filter -> RMSNorm and
    # VocabParallelEmbedding warn at every partial sync)
    log = (gen.megarl_test_logs / "generator_replica0.log").read_text()
    assert "RMSNorm: Failed to load weights" not in log and "VocabParallelEmbedding: Failed to load" not in log
    # only the merged targets: no embedding, no norm (break: no skip -> hf_params * 4)
    assert second["sync/bytes_sent"] == targets * 4, (second["sync/bytes_sent"], targets * 4, hf_params * 4)
    assert second["sync/probe_gap"] < 1e-3  # fp32 probe bound (controller/weight_sync.py)
    prompts = [[1, 504, 3180, 314], [1, 2683, 314, 253, 1345]]
    delta = _greedy(gen, prompts)
    lp = compute_logprobs(trainer.model, delta, temperature=1.0).logprobs
    # the engine after the partial sync holds the trainer's merged policy (fp32 bound: test_controller.py, 10x)
    assert float(((lp - delta.behav_logprobs).abs() * delta.loss_mask).max()) < 1e-3
    # reference: a full merged sync of the same weights (a new spec, so a new sender whose first sync is full)
    sync.strategy.push_to_replica(0, 3)
    full = _greedy(gen, prompts)
    assert full.input_ids.tolist() == delta.input_ids.tolist()
    # the same fp32 weights in the same engine, the same batch: the same bits (break: skip a target -> stale B)
    assert torch.equal(full.behav_logprobs, delta.behav_logprobs)


def _reshard_worker(rank, world, hf_dir, step_dir, batch):
    from megarl.models.layouts import ModelDims
    from megarl.trainer.checkpoint import load_checkpoint
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.model import build_gpt_model, read_hf_config
    from megarl.trainer.optimizer import build_training
    from megarl.utils.dist import init_model_parallel

    init_model_parallel(2, 1, seed=1)
    model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)))
    load_hf_into_model(model, hf_dir)
    objs = build_training(TrainerConfig(tp=2, lora_rank=RANK, lora_alpha=ALPHA), model, total_steps=2)
    load_checkpoint(step_dir, model=objs.model, optimizer=objs.optimizer, scheduler=objs.scheduler)
    return compute_logprobs(model, batch, micro_batch_size=2, temperature=1.0).logprobs


def test_checkpoint_keeps_the_adapters_resume_and_reshard(lora_trainer, tiny_llama_tied_dir):
    from megarl.trainer.checkpoint import load_checkpoint
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.lora import lora_modules
    from megarl.trainer.train_step import train_step

    cfg, trainer = lora_trainer
    batch = _batch(49152)
    train_step(trainer.objs, batch, loss_name="aipo", loss_params={"rho": 4.0}, micro_batch_size=1,
               current_version=0)  # the optimizer holds state (megatron saves none before a step)
    want = {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone()) for n, m in lora_modules(trainer.model).items()}
    assert any(bool(b.abs().sum() > 0) for _, b in want.values())
    lp = compute_logprobs(trainer.model, batch, micro_batch_size=2, temperature=1.0).logprobs
    path = trainer.save()
    with torch.no_grad():
        for m in lora_modules(trainer.model).values():
            m.lora_A.zero_()
            m.lora_B.zero_()
    load_checkpoint(path, model=trainer.objs.model, optimizer=trainer.objs.optimizer,
                    scheduler=trainer.objs.scheduler)
    for n, m in lora_modules(trainer.model).items():
        assert torch.equal(m.lora_A, want[n][0]) and torch.equal(m.lora_B, want[n][1]), n
    # reshard: the TP=1 checkpoint loaded at TP=2 (A of row-parallel and B of column-parallel layers split)
    tp2 = run_multiprocess(_reshard_worker, 2, str(tiny_llama_tied_dir), str(path), batch, timeout_s=600)
    assert (tp2[0] - lp).abs().max() < FP32_BOUND


def test_checkpoint_names_its_base_and_resume_refuses_another(lora_trainer, tiny_llama_tied_dir, tmp_path):
    """meta.json names the base (its folder and a sha256 of its weight files, by hand here); the same files in
    another folder resume, one changed weight is refused with the model.path to set."""
    import hashlib
    import json
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from megarl.trainer.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
    from megarl.trainer.model import unwrap

    cfg, trainer = lora_trainer
    path = latest_checkpoint(trainer.checkpoint_dir) or trainer.save()
    lora = json.loads((path / "meta.json").read_text())["lora"]
    files = sorted(Path(tiny_llama_tied_dir).glob("*.safetensors"))
    assert files
    hand = hashlib.sha256("".join(f"{f.name} {hashlib.sha256(f.read_bytes()).hexdigest()}\n"
                                  for f in files).encode()).hexdigest()
    assert (lora["rank"], lora["alpha"], sorted(lora["targets"])) == (RANK, ALPHA, sorted(cfg.trainer.lora_targets))
    assert lora["base"] == {"path": str(Path(tiny_llama_tied_dir).resolve()), "sha256": hand}
    m = unwrap(trainer.model)
    source = m.megarl_source
    copy, other = tmp_path / "copy", tmp_path / "other"
    shutil.copytree(tiny_llama_tied_dir, copy)
    shutil.copytree(tiny_llama_tied_dir, other)
    tensors = load_file(str(other / files[0].name))
    norm = next(k for k in tensors if k.endswith("norm.weight"))
    tensors[norm] = tensors[norm] + 1e-3  # a frozen base tensor moved: another policy under the same adapters
    save_file(tensors, str(other / files[0].name), metadata={"format": "pt"})
    try:
        m.megarl_source = str(copy)  # the same weight files elsewhere: the same base (break: hash the path)
        load_checkpoint(path, model=trainer.objs.model, optimizer=None, load_rng=False)
        m.megarl_source = str(other)  # break: hash names and sizes only -> loads
        with pytest.raises(CheckpointError, match=re.escape(f"set model.path={Path(tiny_llama_tied_dir).resolve()}")):
            load_checkpoint(path, model=trainer.objs.model, optimizer=None, load_rng=False)
    finally:
        m.megarl_source = source


def test_convert_writes_merged_weights_and_peft_adapters(lora_trainer, tiny_llama_tied_dir, tmp_path):
    """`megarl convert mcore-to-hf` of a LoRA checkpoint: HF transformers loads the merged folder and gives the
    trainer's logprobs; --adapters-only writes peft's files whose W + alpha/r B A (plain torch, and peft itself)
    is the merged export."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.cli import main
    from megarl.trainer.checkpoint import latest_checkpoint, load_checkpoint
    from megarl.trainer.logprobs import compute_logprobs

    cfg, trainer = lora_trainer
    path = latest_checkpoint(trainer.checkpoint_dir)
    if path is None:  # run alone: a step first (B != 0; megatron saves no optimizer state before one)
        _set_nonzero_b(trainer.model, 1)
        from megarl.trainer.train_step import train_step

        train_step(trainer.objs, _batch(49152), loss_name="aipo", loss_params={"rho": 4.0}, micro_batch_size=1,
                   current_version=0)
        path = trainer.save()
    load_checkpoint(path, model=trainer.objs.model, optimizer=None, load_rng=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 4000, (2, 12), generator=g)
    batch = RolloutBatch.from_sequences(tokens.tolist(), [[0.0] * 4 + [1.0] * 8] * 2, behav_logprobs=[[-6.0] * 12] * 2,
                                        advantages=[1.0, -1.0], versions=[[0] * 12] * 2)
    trainer_lp = compute_logprobs(trainer.model, batch, micro_batch_size=2, temperature=1.0).logprobs
    merged_dir, peft_dir = tmp_path / "merged", tmp_path / "peft"
    assert main(["convert", "mcore-to-hf", "--mcore", str(path), "--out", str(merged_dir)]) == 0
    assert main(["convert", "mcore-to-hf", "--mcore", str(path), "--out", str(peft_dir), "--adapters-only"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_tied_dir).eval()
    with torch.no_grad():
        logits, base_logits = merged(tokens).logits.float(), base(tokens).logits.float()
    hf_lp = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    # both fp32, other kernels: tests/e2e/test_cli_convert.py's 2e-3 (20x the 1e-4 logit-rounding bound)
    assert (hf_lp - trainer_lp[:, 1:]).abs().max() < 2e-3
    assert (logits - base_logits).abs().max() > 0.05  # the export is not the base (break: merge skipped)

    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["r"], conf["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert sorted(conf["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])
    assert conf["base_model_name_or_path"] == str(Path(tiny_llama_tied_dir).resolve())
    adapters = load_file(str(peft_dir / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapters
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in adapters
    assert len(adapters) == 2 * 7 * 2  # layers x projections x (A, B)
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    for k in [k for k in adapters if k.endswith("lora_A.weight")]:
        module = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        a, b = adapters[k], adapters[k.replace("lora_A", "lora_B")]
        assert a.shape[0] == RANK and b.shape[1] == RANK
        w = base_sd[f"{module}.weight"] + (ALPHA / RANK) * (b @ a)
        # fp32 on both sides, the same three roundings (a 4-term dot, a scale, an add) in another order:
        # |W + delta| < 4 here, 3 roundings x 2 sides x 2^-24 x 4 ~ 1.4e-6 (break: a wrong q/k/v row split
        # or a transposed A is off by the delta itself, ~1e-2)
        assert (w - merged_sd[f"{module}.weight"]).abs().max() < 2e-6, module
    try:
        from peft import PeftModel
    except ImportError:
        return
    wrapped = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_tied_dir), str(peft_dir)).eval()
    with torch.no_grad():
        peft_logits = wrapped(tokens).logits.float()
    # peft adds x A^T B^T beside x W^T (factored): other summation order than the merged W; fp32 logit rounding
    # bound of tests/e2e/test_trainer_model.py (1e-4), the logits being O(1)
    assert (peft_logits - logits).abs().max() < 1e-4


def test_memory_plan_counts_lora(tiny_llama_tied_dir):
    """Frozen base: gradients and optimizer state for the adapters only (hand counts above)."""
    import json

    from megarl.config.memory import trainer_plan
    from megarl.models.layouts import ModelDims

    dims = ModelDims.from_hf_config(json.loads((Path(tiny_llama_tied_dir) / "config.json").read_text()))
    hf_params, adapters = _hand_counts(tiny_llama_tied_dir)
    kw = dict(tp=1, pp=1, dp=1, params_dtype="bfloat16", distributed_optimizer=True, seq=64, micro_batch=1)
    full, lora = trainer_plan(dims, **kw), trainer_plan(dims, **kw, lora_rank=RANK)
    assert full["gradients"] == hf_params * 4 and full["optimizer"] == hf_params * 12  # fp32 grads; m, v, master
    assert lora["gradients"] == adapters * 4 and lora["optimizer"] == adapters * 12
    assert lora["weights"] == (hf_params + adapters) * 2
    c = json.loads((Path(tiny_llama_tied_dir) / "config.json").read_text())
    h, f, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    assert lora["lora_merged"] == c["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * f) * 2
    assert sum(lora.values()) < sum(full.values())


def test_bench_lora_quick(tmp_path):
    """`megarl bench lora --quick` runs both modes side by side and writes its JSON + PNG; the bytes it reports
    are the plan's (a LoRA sync after the first sends the targets alone; the first sends everything)."""
    import json
    import subprocess
    import sys

    rc = subprocess.call([sys.executable, "-m", "megarl.cli", "bench", "lora", "--quick", "--out", str(tmp_path)],
                         timeout=900)
    assert rc == 0
    r = json.loads((tmp_path / "bench_lora.json").read_text())
    plan = r["plan_bytes"][0]
    assert r["bytes_sent"]["full"][-1] == plan["full_bytes"] == r["bytes_sent"]["lora"][0]
    assert r["bytes_sent"]["lora"][-1] == plan["lora_bytes"] < plan["full_bytes"]  # break: no skip -> equal
    assert r["counts"]["lora"]["train/trainable_params"] < r["counts"]["full"]["train/trainable_params"]
    assert set(r["median_s"]) == {"step_full", "step_lora", "sync_full", "sync_lora"}
    assert (tmp_path / "bench_lora.png").stat().st_size > 1000


@pytest.mark.parametrize("transport", ["zero_copy", "gloo"])
def test_partial_sync_lands_into_a_receiver_built_for_the_full_spec(transport):
    """Senders of a partial sync (LoRA's skip: every non-target module's tensors) and workers whose receiver
    was built for the full spec, as a vLLM worker's is: the senders' tables name the skip, the workers land
    exactly the targets' engine parameters (Qwen2: the qkv bias with its weight), bit for bit, and nothing of
    the skipped ones. TP2 -> TP2, gloo buckets smaller than a parameter (many groups and rounds)."""
    import dataclasses
    import multiprocessing as mp

    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
    from megarl.ddma.plan import plan_sync
    from megarl.ddma.sync import SyncSpec, host_store, skipped_params
    from megarl.trainer.config import LORA_TARGETS
    from megarl.trainer.ddma import frozen_skip
    from tests.harness.ddma import TIMEOUT_S, _dims, _expected, _receiver_main, _sender_main

    dims = _dims("qwen2_kv2")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(2, 1)
    store = host_store()
    full = SyncSpec(dims, src, dst, "127.0.0.1", store.port, transport=transport, timeout_s=TIMEOUT_S,
                    bucket_bytes=4096)
    part = dataclasses.replace(full, skip=frozen_skip(plan_sync(dims, src, dst), LORA_TARGETS))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megarl.ddma.sync", "tests.harness.ddma"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_sender_main, args=(part, r, [1], torch.float32, q)) for r in src.ranks()]
    procs += [ctx.Process(target=_receiver_main, args=(full, r, [1], False, q)) for r in dst.ranks()]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            kind, rank, a, b = q.get(timeout=TIMEOUT_S * 2)
            assert kind in ("sent", "got"), f"{rank}: {kind}\n{a}"
            if kind == "got":
                import io

                got[rank] = torch.load(io.BytesIO(b[0]))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    for rank, tensors in got.items():
        want = _expected(dims, dst, 1, torch.float32, torch.bfloat16)[rank.tp]
        skipped = skipped_params(part, rank)
        assert skipped and set(tensors) == set(want) - skipped  # break: skip ignored -> every parameter lands
        assert any("qkv_proj.bias" in n for n in tensors) and not any("norm" in n or "embed" in n for n in tensors)
        for n, t in tensors.items():
            assert torch.equal(t.view(torch.int16), want[n].view(torch.int16)), (rank, n)
