"""megarl/config/job.py: the resolved job, frozen before any executor starts, with the job's one device
rule, shared by the Slurm launcher and the controller; the input config is left as written.
Torch-free apart from counting visible GPUs; no executor is started."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megarl.cluster.slurm import SlurmEnv, build_role_map, placement_lines
from megarl.config import load_config
from megarl.config.job import ResolvedJob, job_device, resolve_job, resolved_sync

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml")


def test_the_one_device_rule():
    assert [job_device("cpu", 8), job_device("cuda", 0), job_device("auto", 0), job_device("auto", 2)] == \
        ["cpu", "cuda", "cpu", "cuda"]


def test_an_allocation_without_gpus_launcher_and_controller_agree(monkeypatch, tiny_llama_dir):
    """Slurm nodes that look like GPU nodes (CUDA_VISIBLE_DEVICES set: the validator's cuda_expected says
    CUDA) in an allocation that asked for no GPUs: the launcher placed the pools on the CPU (gloo), and the
    controller task, which takes the role map's job environment, resolves the same device and transport.
    Before step 1b the controller chose nccl here by its own rule (planted back: this test fails)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("MEGARL_JOB_DEVICE", raising=False)
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"})
    cfg = load_config(TINY, [f"model.path={tiny_llama_dir}", "cluster.launcher=slurm", "cluster.device=auto", "cluster.ranks_per_node=1",
                             "sync.transport=auto"])
    rmap = build_role_map(env, cfg)
    assert (rmap.device, rmap.transport) == ("cpu", "gloo")
    for key, value in rmap.job_env().items():  # what megarl rank --role controller puts in its environment
        monkeypatch.setenv(key, value)
    job = resolve_job(cfg, None)
    assert (job.device, job.sync.transport) == (rmap.device, rmap.transport)
    # GPUs in the allocation: both say CUDA over other hosts
    gpu_map = build_role_map(SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
                                                "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "2"}), cfg)
    for key, value in gpu_map.job_env().items():
        monkeypatch.setenv(key, value)
    assert (gpu_map.device, gpu_map.transport) == ("cuda", "nccl") == (resolve_job(cfg, None).device,
                                                                      resolve_job(cfg, None).sync.transport)


def test_the_job_is_frozen_and_the_input_config_is_left_as_written(tiny_llama_dir, tmp_path):
    cfg = load_config(TINY, [f"model.path={tiny_llama_dir}", "cluster.device=cpu", "sync.transport=auto",
                             "sync.probe_max_gap=0", "generator.dtype=float32", "trainer.params_dtype=float32"])
    before = dataclasses.asdict(cfg)
    job = resolve_job(cfg, tmp_path / "step_00000002")
    assert isinstance(job, ResolvedJob) and job.model_dir == Path(tiny_llama_dir)
    assert (job.device, job.sync.transport, job.devices.trainer) == ("cpu", "zero_copy", None)
    assert job.sync.probe_max_gap == 1e-3  # fp32 engine, fp32 trainer, engine wire (ddma/config.py default_probe_gap)
    assert job.resume_dir == tmp_path / "step_00000002"
    assert dataclasses.asdict(cfg) == before  # transport 'auto', probe bound 0: as the user wrote them
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.device = "cuda"  # type: ignore[misc]
    assert resolved_sync(cfg).transport == "zero_copy"


def test_the_launcher_lists_every_role_of_the_device_plan(monkeypatch):
    """A role (a critic, a judge, a teacher) appears in `megarl launch slurm --dry-run` by being a field of
    config/placement.py's DevicePlan: here a plan with an extra role the launcher never names."""
    import megarl.config.placement as placement

    @dataclasses.dataclass(frozen=True)
    class Plan:
        trainer: list[int] | None
        generator: list[int] | None
        verifier: list[int] | None
        note: str

    monkeypatch.setattr(placement, "DevicePlan", Plan)
    monkeypatch.setattr(placement, "device_plan", lambda cfg, gpus: Plan(None, [0], [1, 2], "n"))
    (line,) = placement_lines(None, 4, "n3")
    assert line == ("device plan on n3: trainer no GPU here (its pool, or the CPU); generator GPU(s) 0; "
                    "verifier GPU(s) 1,2")


def test_validation_does_not_guess_the_device_the_job_decides(monkeypatch, tiny_llama_dir):
    """cluster.device=auto on a node that looks like a GPU node, sync.transport=gloo, an allocation without
    GPUs: validation no longer refuses gloo by its own guess (CUDA), the job's rule picks the CPU and gloo
    fits; an explicit cluster.device=cuda is still refused before anything starts."""
    from megarl.config import ConfigError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    over = [f"model.path={tiny_llama_dir}", "cluster.launcher=slurm", "cluster.ranks_per_node=1", "sync.transport=gloo"]
    cfg = load_config(TINY, over + ["cluster.device=auto"])
    env = SlurmEnv.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"})
    assert build_role_map(env, cfg).transport == "gloo"
    with pytest.raises(ConfigError, match="sync.transport=gloo moves host memory"):
        load_config(TINY, over + ["cluster.device=cuda"])


# Flags of the machines docs/results.md names: an AVX2-only AMD EPYC (no bf16 hardware), an AMX Xeon.
EPYC_AVX2 = "fpu vme de pse tsc msr sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c rdrand avx2 bmi2 sha_ni"
XEON_AMX = "fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"


def test_bf16_on_a_cpu_without_bf16_hardware_is_warned_naming_the_knob():
    """A CPU job training in bf16 where neither amx_bf16 nor avx512_bf16 is in the cpuinfo flags: oneDNN
    emulates it (the quickstart's first step did not finish in 6 minutes there), so the start says so once,
    naming trainer.params_dtype=float32. Not on a CPU that has either flag, nor for fp32, nor on CUDA."""
    from megarl.config.job import bf16_cpu_problem, cpu_flags

    line = bf16_cpu_problem("cpu", "bfloat16", EPYC_AVX2)
    assert line is not None and line.startswith("trainer.params_dtype=bfloat16 on a CPU without bf16 matmul "
                                                "hardware (no amx_bf16 or avx512_bf16 in /proc/cpuinfo)")
    assert "Set trainer.params_dtype=float32" in line
    assert bf16_cpu_problem("cpu", "bfloat16", XEON_AMX) is None
    assert bf16_cpu_problem("cpu", "bfloat16", "fpu avx2 avx512_bf16") is None  # either flag is enough
    assert bf16_cpu_problem("cpu", "bfloat16", "fpu avx2 amx_bf16") is None
    assert bf16_cpu_problem("cpu", "float32", EPYC_AVX2) is None
    assert bf16_cpu_problem("cuda", "bfloat16", EPYC_AVX2) is None
    assert bf16_cpu_problem("cpu", "bfloat16", None) is None  # flags unknown (not Linux): no guess
    assert bf16_cpu_problem("cpu", "bfloat16", "avx512_bf16x") is not None  # whole flags, not substrings


def test_the_job_start_warns_once_for_bf16_on_such_a_cpu(monkeypatch, tiny_llama_dir, caplog):
    import logging

    from megarl.config import job as job_module

    cfg = load_config(TINY, [f"model.path={tiny_llama_dir}", "cluster.device=cpu", "trainer.params_dtype=bfloat16"])
    for flags, expected in ((EPYC_AVX2, 1), (XEON_AMX, 0)):
        monkeypatch.setattr(job_module, "cpu_flags", lambda: flags)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megarl"):
            resolve_job(cfg, None)
        warned = [r for r in caplog.records if "trainer.params_dtype=float32" in r.getMessage()]
        assert len(warned) == expected and all(r.levelno == logging.WARNING for r in warned), caplog.text


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    from megarl.config.job import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n\nprocessor\t: 1\n"
                    "flags\t\t: other\n")
    assert cpu_flags(str(info)).split() == ["fpu", "avx2"]
    assert cpu_flags(str(tmp_path / "absent")) is None


def test_the_built_in_model_is_announced_only_when_it_is_converted(monkeypatch, tmp_path, caplog):
    """resolve_model says "converting ..." before a conversion and nothing when the folder is cached; the
    conversion runs without transformers' progress bars (they left empty lines among the log lines)."""
    import logging

    from megarl.config.job import resolve_model
    from megarl.models import smollm2

    monkeypatch.setenv("MEGARL_DATA_DIR", str(tmp_path))
    calls = []

    def fake_convert(gguf, out, dtype, progress=True):
        calls.append(progress)
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(smollm2, "convert_gguf_to_hf", fake_convert)
    with caplog.at_level(logging.INFO, logger="megarl"):
        first = resolve_model("builtin:smollm2")
        said = [r.getMessage() for r in caplog.records if "SmolLM2" in r.getMessage()]
        caplog.clear()
        again = resolve_model("builtin:smollm2")
        said_again = [r.getMessage() for r in caplog.records if "SmolLM2" in r.getMessage()]
    assert first == again and first.parent == tmp_path / "models" and calls == [False]
    assert said == [f"converting the built-in SmolLM2-135M-Instruct from its GGUF (once, ~1 min) into {first}"]
    assert said_again == []


def test_a_quiet_conversion_draws_no_progress_bar(capsys):
    """The two bars a conversion draws (the GGUF reader's plain tqdm, transformers' own) are off inside
    and back after."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from megarl.models.gguf_to_hf import _no_progress_bars

    with _no_progress_bars():
        list(gguf_utils.tqdm(range(3), desc="Converting"))
        list(hf_logging.tqdm(range(3), desc="Writing model shards"))
    assert capsys.readouterr().err == ""
    list(gguf_utils.tqdm(range(3), desc="Converting"))
    list(hf_logging.tqdm(range(3), desc="Writing model shards"))
    err = capsys.readouterr().err
    assert "Converting" in err and "Writing model shards" in err
