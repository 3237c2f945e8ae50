"""What the controller does before the loop: this process's device and log, and the executors.

``prepare_process`` runs first (cluster.device hides or insists on CUDA before torch is imported, one
NCCL setting for the whole job, the C++ extension's announcement); the job is then resolved once
(megarl/config/job.py) and :func:`start_executors` starts the trainer, generator, reward executor,
teacher and critic from it. A new role (a critic, a judge, a teacher) is started here, beside them, and handed to the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config import ConfigError
from megarl.config.job import ResolvedJob
from megarl.config.schema import MegaRLConfig
from megarl.executors.base import start_in_turn, start_together
from megarl.utils.procs import parse_cpu_list

if TYPE_CHECKING:  # these import torch, which must wait until select_device has run
    from megarl.controller.run import RunFolder
    from megarl.critic.executor import CriticExecutor
    from megarl.executors.base import RewardScorer
    from megarl.generator.executor import GeneratorExecutor
    from megarl.teacher.executor import TeacherExecutor
    from megarl.trainer.executor import TrainerExecutor

log = logging.getLogger("megarl")


def controller_log_path(cfg: MegaRLConfig) -> Path:
    """``<run folder>/logs/controller.log``: the controller's log, with the traceback of whatever ends it."""
    return Path(cfg.logging.out_dir) / cfg.name / "logs" / "controller.log"


def prepare_process(cfg: MegaRLConfig) -> None:
    """Before anything imports torch or starts: cluster.device, the job's NCCL setting, the C++ extension."""
    from megarl.ddma.transport.choice import job_nccl_env

    select_device(cfg.cluster.device)
    os.environ.update(job_nccl_env(os.environ))  # one NCCL setting for every process the job starts
    announce_native(cfg.sync.native)


@dataclasses.dataclass(frozen=True)
class Executors:
    """The job's started executors (the controller holds handles, never weights)."""
    trainer: TrainerExecutor
    generator: GeneratorExecutor
    reward: RewardScorer  # the rule-reward pool, or the judge (reward.model)
    teacher: TeacherExecutor | None = None  # algorithm.teacher with distill_coef > 0
    critic: CriticExecutor | None = None  # algorithm.advantage gae or vtrace: the value model


def start_executors(cfg: MegaRLConfig, job: ResolvedJob, stack: ExitStack, run: RunFolder) -> Executors:
    """Start trainer, generator, reward executor (the rule pool, or the judge with reward.model), teacher
    and critic on ``stack`` (closed in reverse when the job ends). A new role is made here and started
    with the others. They start together (their start-ups overlap: the job starts in the slowest one's
    time), or one after the other when they share devices (cluster.share_devices)."""
    from megarl.critic.executor import make_critic
    from megarl.generator.executor import GeneratorExecutor
    from megarl.reward.judge import reward_executor
    from megarl.teacher.executor import make_teacher
    from megarl.trainer.executor import TrainerExecutor

    # the trainer's own input: the step folder the job pinned (cfg keeps what the user asked for)
    t = dataclasses.replace(cfg.trainer, resume_from=str(job.resume_dir) if job.resume_dir else None)
    log.info("starting the trainer (Megatron, tp=%d pp=%d dp=%d, one process per rank) from %s",
             t.tp, t.pp, t.dp, job.model_dir)
    cpus = parse_cpu_list(cfg.cluster.trainer_cpus) or None  # cluster.trainer_cpus: pin the ranks
    trainer = TrainerExecutor(t, cfg.algorithm, job.model_dir, total_steps=cfg.controller.steps, run_dir=run.path,
                              cpus=cpus, devices=job.devices.trainer, launcher=cfg.cluster.launcher)
    log.info("starting the generator (%d vLLM replica(s), tp=%d)", cfg.generator.replicas, cfg.generator.tp)
    if cfg.controller.deterministic:
        log.info("controller.deterministic: per-request seeds from generator.seed=%d, one sequence at a time per "
                 "engine (generator.max_num_seqs=%d not used), no prefix cache, every sync waits for the rounds in "
                 "flight: slower, reproducible across kill + resume", cfg.generator.seed, cfg.generator.max_num_seqs)
    # the replicas' logs beside the trainer ranks' (under Slurm, srun's replicas attach and log there too)
    generator = GeneratorExecutor(cfg.generator, job.model_dir, cuda_devices=job.devices.generator,
                                  launcher=cfg.cluster.launcher, log_dir=cfg.generator.log_dir or run.path / "logs",
                                  deterministic=cfg.controller.deterministic)
    # reward.model: the judge on its own vLLM replicas; else the rule-reward pool (reward.fn)
    reward = reward_executor(cfg, job.devices, run.path / "logs" / "judge")
    teacher = make_teacher(cfg, job, run)  # algorithm.teacher: forward-only ranks, or None
    critic = make_critic(cfg, job, run)  # gae/vtrace: the value model's ranks, resumed at the trainer's step
    roles = {"trainer": trainer, "generator": generator, "judge": reward if cfg.reward.model else None,
             "teacher": teacher, "critic": critic}
    # cluster.share_devices: one after the other, so that what the others hold is taken when vLLM sizes
    # its KV cache from the free memory (the memory plan, megarl/config/memory.py, assumes it); else
    # every role has devices of its own (config/placement.py): Megatron builds while vLLM loads
    start = start_in_turn if cfg.cluster.share_devices else start_together
    ready = start(stack, {name: ex for name, ex in roles.items() if ex is not None})
    log.info("executors ready in %.1fs (%s; %s)", max(ready.values()),
             ", ".join(f"{name} {s:.1f}s" for name, s in ready.items()),
             "one after the other: cluster.share_devices" if cfg.cluster.share_devices else "started together")
    if not cfg.reward.model:
        stack.enter_context(reward)  # the rule pool: a few scoring processes, started in a moment
    if cpus:
        log.info("trainer ranks pinned: %s", "; ".join(f"rank {h['rank']} cores {h['cores']}"
                                                       for h in trainer.health()))
    if trainer.step_count:
        log.info("trainer: resuming from the step-%d checkpoint (trainer.resume_from=%s)", trainer.step_count,
                 cfg.trainer.resume_from)
    return Executors(trainer, generator, reward, teacher, critic)


def model_dims(model_dir: Path):
    """The architecture facts the DDMA planner needs (a ModelDims), from the HF config (no weights)."""
    from megarl.models.layouts import ModelDims
    from megarl.trainer.model import read_hf_config

    return ModelDims.from_hf_config(read_hf_config(model_dir))


def announce_native(mode: str) -> None:
    """Without the C++ extension: one WARNING naming what runs in Python (sync.native=auto), or a
    ConfigError (sync.native=required). Executor processes inherit the announcement and stay quiet."""
    from megarl import native

    message = native.fallback_message()
    if message is None:
        return
    if mode == "required":
        raise ConfigError([f"sync.native=required: {message.split('; these run')[0]}; build it with "
                           f"{native.BUILD_HINT} or set sync.native=auto"])
    log.warning(message)
    native.mark_announced()


def select_device(device: str) -> None:
    """cluster.device: 'cpu' hides CUDA from this process and the engines it starts (before torch
    is imported here); 'cuda' insists on a device."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
            raise ConfigError(["cluster.device=cpu: torch was imported with CUDA visible before the job "
                               "started; set CUDA_VISIBLE_DEVICES= in the environment instead"])
    elif device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(["cluster.device=cuda: no CUDA device is visible to this process; use "
                               "cluster.device=auto or cpu, or check CUDA_VISIBLE_DEVICES"])


def setup_logging() -> None:
    """The console at INFO (start, one progress line a step, waits that turned slow, warnings, the
    summary); megarl's DEBUG (every wait, every weight load) goes to the log files only (command_log)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        logging.getLogger().handlers[0].setLevel(logging.INFO)
        logging.getLogger("megarl").setLevel(logging.DEBUG)  # records reach the handlers; each keeps its level
    for noisy in ("megatron", "vllm", "transformers"):  # their INFO is per-parameter detail
        logging.getLogger(noisy).setLevel(logging.WARNING)


__all__ = ["announce_native", "controller_log_path", "model_dims", "prepare_process", "select_device",
           "setup_logging", "start_executors", "Executors"]
