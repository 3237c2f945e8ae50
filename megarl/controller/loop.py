"""The controller: the one place the RL loop is written.

Each step: keep up to ``max_policy_lag`` later batches generating (controller/rollouts.py), take this
step's rollouts, score them, keep the groups whose rewards vary (algorithm.dynamic_sampling, refilling
from further prompts: controller/dynamic_sampling.py), train, sync the weights. With ``max_policy_lag: 0`` that is the
synchronous on-policy baseline; with ``k > 0`` the generator works on the next batches while the
trainer trains (LlamaRL-style, 1..k versions of lag, corrected by the loss). The trainer's TP x PP x DP
Megatron ranks and the generator's vLLM replicas run in their own processes; weights travel by DDMA
(controller/weight_sync.py), each worker receiving only its shard, checksummed and probed.
Placement (config/placement.py), the controller's checkpoint (controller/state.py), the run
folder (controller/run.py) and the busy/idle accounting and run summary (controller/summary.py)
live beside the loop, not inside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.config import ConfigError
from megarl.config.placement import DevicePlan, device_plan
from megarl.config.schema import BUILTIN_SMOLLM2, MegaRLConfig
from megarl.controller.dynamic_sampling import DynamicSampling
from megarl.controller.evaluation import EvalResult, StrictScorer
from megarl.controller.prompts import PromptSource
from megarl.controller.rollouts import RolloutQueue, prompts_crc32, trained_record
from megarl.controller.staleness import push_due
from megarl.controller.run import RunFolder, claim_run_folder
from megarl.controller.state import stage_controller_state
from megarl.controller.summary import ExecutorActivity
from megarl.executors.base import Generator, RewardScorer, Trainer
from megarl.rollout import Sample
from megarl.utils.metrics import PhaseTimer
from megarl.utils.faults import pause_point
from megarl.utils.procs import Preempted, Preemption, parse_cpu_list, signals_raise

if TYPE_CHECKING:  # these import (or may import) torch, which must wait until _select_device has run
    from megarl.controller.turns import EnvironmentTurns
    from megarl.controller.weight_sync import WeightSync
    from megarl.generator.executor import GeneratorExecutor
    from megarl.models.layouts import ModelDims
    from megarl.reward import RewardPool
    from megarl.trainer.executor import TrainerExecutor

log = logging.getLogger("megarl")


def run_job(cfg: MegaRLConfig) -> int:
    """Run the job described by ``cfg``; returns a process exit code. Its log is also written to
    ``<run folder>/logs/controller.log``, with the full traceback of whatever ends it
    (megarl.utils.errors: the console gets one line naming that file)."""
    from megarl.utils.errors import command_log

    _setup_logging()
    with command_log(controller_log_path(cfg)):
        return _run_job(cfg)


def controller_log_path(cfg: MegaRLConfig) -> Path:
    return Path(cfg.logging.out_dir) / cfg.name / "logs" / "controller.log"


def _run_job(cfg: MegaRLConfig) -> int:
    from megarl.ddma.transport.choice import job_nccl_env

    _select_device(cfg.cluster.device)
    os.environ.update(job_nccl_env(os.environ))  # one NCCL setting for every process the job starts
    cfg = claim_run_folder(cfg)  # resume (said first, with the step) or start over, never mixing two runs
    _announce_native(cfg.sync.native)
    from megarl.controller.weight_sync import WeightSync

    model_dir = resolve_model(cfg.model.path)
    devices = place_devices(cfg)
    sync = resolved_sync(cfg, devices)  # before any executor holds a GPU (it may ask CUDA about peer access)
    prompts = PromptSource(cfg, model_dir)
    with ExitStack() as stack:
        # First in, last out: SIGTERM/SIGINT/SIGHUP raise JobInterrupted here, the stack closes
        # every executor below, then the handlers are restored (megarl.utils.procs).
        # Once the loop runs, SIGTERM (a plain run: also the first SIGINT) checkpoints before the job
        # exits, within cluster.preempt_grace_s; under a launcher it then exits for a requeue
        # (PREEMPTED_EXIT), a plain run with 128 + signum; a second signal exits a plain run at once.
        preempt = Preemption(requeue=cfg.cluster.launcher == "slurm", grace_s=cfg.cluster.preempt_grace_s)
        stack.enter_context(signals_raise(preemption=preempt))
        run = stack.enter_context(RunFolder(cfg, n_eval=len(prompts.held)))
        trainer, generator, reward = start_executors(cfg, stack, model_dir, devices, run)
        weights = WeightSync(sync, trainer, generator, dims=model_dims(model_dir), generator_cfg=cfg.generator,
                             probe_prompt=prompts.eval_set()[1][0], pad_id=prompts.pad_id,
                             quiesce=cfg.controller.deterministic)
        log.info("weight sync: %s", describe_sync(cfg, sync))
        train(cfg, run, prompts, trainer, generator, reward, weights, preempt)
        run.finish(cfg.controller.steps)
    return 0


def train(cfg: MegaRLConfig, run: RunFolder, prompts: PromptSource, trainer: Trainer, generator: Generator,
          reward: RewardScorer, weights: WeightSync, preempt: Preemption | None = None) -> None:
    """The RL loop. Each step: keep up to ``max_policy_lag`` later batches generating, take this
    step's rollouts, score them, keep the groups whose rewards vary (dynamic sampling: refilled from
    further prompts), train, sync the weights; evaluate and checkpoint on schedule. A
    preemption abandons the generation wait, or lets a step past it finish, then checkpoints."""
    from megarl.batch import RolloutBatch
    from megarl.trainer.checkpoint import should_save

    steps, every = cfg.controller.steps, cfg.controller.eval_every
    weights.push(trainer.step_count)  # resume-safe start: the engines get the trainer's weights
    held = trainer.step_count  # the version the generator holds (sync.every: it advances only at a push)
    if every and trainer.step_count == 0:  # the baseline the run improves on
        run.log_eval(0, steps, evaluate(generator, prompts, run, step=0))
    rollouts = RolloutQueue(generator, prompts, prompts_per_step=cfg.controller.prompts_per_step,
                            n_samples=cfg.generator.n_samples, max_policy_lag=cfg.controller.max_policy_lag,
                            last_step=steps, deterministic=cfg.controller.deterministic, sync_every=cfg.sync.every)
    sampling = DynamicSampling(enabled=cfg.algorithm.dynamic_sampling, max_refill_rounds=cfg.algorithm.max_refill_rounds,
                               prompts_per_step=cfg.controller.prompts_per_step, run_dir=run.path)
    resume_controller(cfg, run, trainer.step_count, rollouts, sampling)
    activity = ExecutorActivity(generator)
    turns = environment_turns(cfg, generator, prompts)  # None: single turn, each reply scored by reward.fn
    preempt = preempt or Preemption()
    with checkpoint_on_preemption(cfg, trainer, rollouts, preempt, saved=trainer.step_count):
        for step in range(trainer.step_count + 1, steps + 1):
            preempt.check()  # a SIGTERM during the last step is served here
            timer = PhaseTimer()
            activity.begin()
            rollouts.fill(step)  # up to max_policy_lag later batches generate while this one trains
            with timer.phase("generate"):  # waiting for this step's rollouts
                batch = rollouts.take(step, trainer.step_count)
            with preempt.deferred():  # later turns, reward, refills, train, sync, log and save finish before a preemption
                score = rollout_scorer(turns, reward, prompts, timer)
                samples, reward_counts = score(batch.tasks, batch.samples)
                batch.samples = samples  # the scored ones: a multi-turn environment returns new samples
                # dynamic_sampling: all-equal groups out, further prompts in (off: the batch as it is)
                samples, batch_metrics, sampling_record = sampling.select(step, batch, rollouts, score,
                                                                          trainer.step_count, timer, reward_counts)
                advantages = group_advantages(cfg, samples, [s.reward for s in samples])
                with timer.phase("train"):
                    train_metrics = trainer.step(RolloutBatch.from_samples(samples, advantages, pad_id=prompts.pad_id))
                with timer.phase("sync"):  # sync.every: after steps K, 2K, ... and the last (staleness.push_due)
                    pushed = push_due(step, steps, cfg.sync.every)
                    sync_metrics = weights.push(trainer.step_count) if pushed else {}
                    held = trainer.step_count if pushed else held
                sync_metrics.update({"sync/pushed": float(pushed), "sync/generator_version": float(held)})
                times = timer.finish()
                metrics = step_metrics(train_metrics, times, activity.end(times), sync_metrics, batch.lag_metrics,
                                       samples, batch.prompt_ids)
                metrics.update(reward_counts)  # reward/timeouts, reward/errors (samples), reward/worker_deaths
                metrics.update(batch_metrics)  # batch/dropped_groups, batch/refill_rounds, batch/padded_groups
                run.log_samples(step, [trained_record(s) for s in samples])
                sampling.log(sampling_record)
                if every and (step % every == 0 or step == steps):
                    metrics.update(evaluate(generator, prompts, run, step=step))
                if should_save(cfg.trainer, step, steps):
                    metrics["checkpoint/seconds"] = checkpoint(cfg, trainer, rollouts)
                run.log(step, steps, metrics)
            pause_point(f"step_logged@{step}", until=lambda: preempt.requested)  # fault tests: a signal here
                                                                               # lands between two steps
        with preempt.deferred():
            trainer.wait_saves()  # trainer.async_save: the last checkpoint is complete before the job ends


@contextlib.contextmanager
def checkpoint_on_preemption(cfg: MegaRLConfig, trainer: Trainer, rollouts: RolloutQueue,
                             preempt: Preemption, saved: int = 0) -> Iterator[None]:
    """Arms ``preempt`` (a plain run's signals checkpoint from here on). On :class:`Preempted`: save
    the trainer at its current step with the controller's state (the step being generated is in it,
    with its finished samples and partial rollouts), unless that step was just saved on schedule or
    is the one the run resumed from (``saved``), then let it propagate (the job exits with
    PREEMPTED_EXIT under a launcher, 128 + signum in a plain run)."""
    from megarl.trainer.checkpoint import should_save

    preempt.armed = True
    try:
        yield
    except Preempted as exc:
        version = trainer.step_count
        with preempt.deferred():
            if version and version != saved and not should_save(cfg.trainer, version, cfg.controller.steps):
                checkpoint(cfg, trainer, rollouts)
            trainer.wait_saves()  # trainer.async_save: the write in flight, within cluster.preempt_grace_s
        exc.set_step(version)
        if not version and not exc.requeue:
            exc.args = (f"{exc.args[0].split(';')[0]} before the first step was trained: nothing to checkpoint",)
            log.warning("interrupted before the first step was trained: no checkpoint")
        elif exc.requeue:
            log.warning("preempted: checkpoint of step %d in place %.1fs after the signal; exiting for a requeue "
                        "(the restarted job resumes there, losing no step)", version, time.monotonic() - preempt.at)
        else:
            log.warning("interrupted: checkpoint of step %d in place %.1fs after the signal; exiting (rerun the "
                        "same command to resume at step %d)", version, time.monotonic() - preempt.at, version)
        raise


def start_executors(cfg: MegaRLConfig, stack: ExitStack, model_dir: Path, devices: DevicePlan,
                    run: RunFolder) -> tuple[TrainerExecutor, GeneratorExecutor, RewardPool]:
    """Start trainer, generator and reward pool on ``stack`` (closed in reverse when the job ends)."""
    from megarl.generator.executor import GeneratorExecutor
    from megarl.reward import RewardPool
    from megarl.trainer.executor import TrainerExecutor

    t = cfg.trainer
    log.info("starting the trainer (Megatron, tp=%d pp=%d dp=%d, one process per rank) from %s",
             t.tp, t.pp, t.dp, model_dir)
    cpus = parse_cpu_list(cfg.cluster.trainer_cpus) or None  # cluster.trainer_cpus: pin the ranks
    trainer = stack.enter_context(TrainerExecutor(t, cfg.algorithm, model_dir, total_steps=cfg.controller.steps,
                                                  run_dir=run.path, cpus=cpus, devices=devices.trainer,
                                                  launcher=cfg.cluster.launcher))
    if cpus:
        log.info("trainer ranks pinned: %s", "; ".join(f"rank {h['rank']} cores {h['cores']}"
                                                       for h in trainer.health()))
    if trainer.step_count:
        log.info("trainer: resuming from the step-%d checkpoint (trainer.resume_from=%s)", trainer.step_count,
                 t.resume_from)
    log.info("starting the generator (%d vLLM replica(s), tp=%d)", cfg.generator.replicas, cfg.generator.tp)
    if cfg.controller.deterministic:
        log.info("controller.deterministic: per-request seeds from generator.seed=%d, one sequence at a time per "
                 "engine (generator.max_num_seqs=%d not used), no prefix cache, every sync waits for the rounds in "
                 "flight: slower, reproducible across kill + resume", cfg.generator.seed, cfg.generator.max_num_seqs)
    attached = cfg.cluster.launcher == "slurm"  # replicas started by srun on the generator nodes attach here
    generator = stack.enter_context(GeneratorExecutor(cfg.generator, model_dir, cuda_devices=devices.generator,
                                                      launcher=cfg.cluster.launcher,
                                                      log_dir=run.path / "logs" if attached else None,
                                                      deterministic=cfg.controller.deterministic).start())
    reward = stack.enter_context(RewardPool(cfg.reward, cfg.generator.max_new_tokens))
    return trainer, generator, reward


def rollout_scorer(turns: EnvironmentTurns | None, reward: RewardScorer, prompts: PromptSource, timer: PhaseTimer):
    """The step's reward call: (tasks by prompt index, samples) -> (scored samples, reward counts).
    Single turn: the reward pool scores each reply; reward.env: the environment plays the later
    turns and scores the last (controller/turns.py), which is generation time."""
    def score(tasks: list, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        if turns:
            with timer.phase("generate"):
                return turns.play(tasks, samples)
        with timer.phase("reward"):
            return samples, reward.score(samples, [t.answer for t in tasks], prompts.decode) or {}
    return score


def environment_turns(cfg: MegaRLConfig, generator: Generator, prompts: PromptSource) -> EnvironmentTurns | None:
    """The environment ``reward.env`` names, driven turn by turn on ``generator`` (controller/turns.py),
    with the reward's scores; None when it is empty (a single-turn reward, scored by the pool)."""
    r, g = cfg.reward, cfg.generator
    if not r.env:
        return None
    from megarl.controller.turns import EnvironmentTurns
    from megarl.reward.environment import get_environment

    try:
        env = get_environment(r.env, tokenizer=prompts.tokenizer, strict=r.strict, correct=r.correct, wrong=r.wrong)
    except (ValueError, TypeError) as e:
        raise ConfigError([f"reward.env={r.env!r}: {e}"]) from None
    log.info("environment %s: up to generator.max_turns=%d replies per rollout, observations masked out of the loss",
             r.env, g.max_turns)
    return EnvironmentTurns(generator, env, max_turns=g.max_turns, max_new_tokens=g.max_new_tokens,
                            max_model_len=g.max_model_len, truncated_score=r.wrong if r.truncated is None else r.truncated)


def step_metrics(train: dict[str, float], times: dict[str, float], busy: dict[str, float], sync: dict[str, float],
                 lag: dict[str, float], samples: list[Sample], prompt_ids: list[list[int]]) -> dict[str, float]:
    """One step's row of metrics.jsonl: the trainer's (``train/*``), phase times, busy/idle, sync,
    lag, what the samples look like, and the data stream's CRC (a resumed run continues it)."""
    gen_seconds = busy["exec/generator_busy_s"] or lag["gen/batch_latency_s"]
    return {**{f"train/{k}": v for k, v in train.items()}, **times, **busy, **sync, **lag,
            **rollout_metrics(samples, gen_seconds), "data/prompts_crc32": prompts_crc32(prompt_ids)}


def checkpoint(cfg: MegaRLConfig, trainer: Trainer, rollouts: RolloutQueue) -> float:
    """Save the trainer with the controller's part (data cursor, admitted rollouts) staged first, so
    the step folder's manifest covers both (controller/state.py); the seconds it took (with
    trainer.async_save: the snapshot's, the write goes on behind the next step)."""
    t0 = time.monotonic()
    stage_controller_state(cfg, policy_version=trainer.step_count, rollouts=rollouts.state_dict())
    trainer.save()
    return time.monotonic() - t0


def evaluate(generator: Generator, prompts: PromptSource, run: RunFolder, *, step: int) -> dict[str, float]:
    """Greedy replies to every held-out set, scored strictly (never by the training reward): eval/* for
    the single set; with data.eval_paths eval/<name>/* for each, and the first's also as eval/*."""
    t0 = time.monotonic()
    out: dict[str, float] = {}
    for name, tasks, prompt_ids, style in prompts.eval_sets():
        samples = generator.generate(prompt_ids, n_samples=1, sampling={"temperature": 0.0})
        StrictScorer(style, questions=[t.question for t in tasks]).score(samples, [t.answer for t in tasks],
                                                                          prompts.decode)
        run.write_eval_samples(step, [{**({"set": name} if name else {}), "question": tasks[s.prompt_index].question,
                                       "gold": tasks[s.prompt_index].answer, "reply": prompts.decode(s.completion_ids),
                                       "finish_reason": s.finish_reason, "correct": s.correct} for s in samples])
        metrics = EvalResult.of_samples(samples).metrics()
        if name:
            out.update({k.replace("eval/", f"eval/{name}/", 1): v for k, v in metrics.items()})
        if "eval/accuracy" not in out:  # the headline: the first set
            out.update(metrics)
    return {**out, "eval/seconds": time.monotonic() - t0}


def group_advantages(cfg: MegaRLConfig, samples: list[Sample], rewards: list[float]) -> list[float]:
    """Advantages within each prompt's group, found by the samples' group ids (not their order)."""
    import torch

    from megarl.algorithms import advantage_params, compute_advantages

    group_ids = torch.tensor([s.group_id for s in samples], dtype=torch.long)
    return compute_advantages(cfg.algorithm.advantage, torch.tensor(rewards, dtype=torch.float32),
                              group_ids=group_ids, **advantage_params(cfg.algorithm)).tolist()


def rollout_metrics(samples: list[Sample], gen_seconds: float) -> dict[str, float]:
    """What the scored samples of one step look like: reward, and the signs of a hacked reward
    (length, truncation, format). ``gen_seconds``: the generator's busy seconds of the step, so
    ``gen/tokens_per_s`` is the engines' rate also when generation overlaps training."""
    n = max(len(samples), 1)
    tokens = sum(len(s.completion_ids) for s in samples)
    return {"reward/mean": sum(s.reward for s in samples) / n,
            "reward/correct_frac": sum(s.correct for s in samples) / n,
            "reward/format_rate": sum(s.formatted for s in samples) / n,
            "gen/samples": len(samples), "gen/tokens": tokens, "gen/tokens_per_s": tokens / max(gen_seconds, 1e-9),
            "gen/mean_length": tokens / n, "gen/truncated_frac": sum(s.truncated for s in samples) / n}


def resume_controller(cfg: MegaRLConfig, run: RunFolder, version: int, rollouts: RolloutQueue,
                      sampling: DynamicSampling | None = None) -> None:
    """After the trainer resumed at ``version``: drop what later steps of the killed run logged,
    and put back the rollouts admitted ahead of it with the data cursor (controller/state.py)."""
    from megarl.controller.state import load_controller_state
    from megarl.trainer.checkpoint import resume_path

    if sampling is not None:
        sampling.rewind(version)  # a fresh run (0) starts its dynamic_sampling.jsonl empty
    if version == 0:
        return
    run.rewind(version)
    try:
        state = load_controller_state(resume_path(cfg.trainer, run.path), policy_version=version,
                                      data_seed=cfg.data.seed)
        if state is not None:
            got = rollouts.load_state_dict(state)
            log.info("resume: %d admitted batch(es) back, %d finished sample(s) kept, %d partial rollout(s) "
                     "continue under weights v%d", got["batches"], got["finished"], got["unfinished"], version)
    except ValueError as e:
        raise ConfigError([f"trainer.resume_from={cfg.trainer.resume_from!r}: {e}"]) from None


def model_dims(model_dir: Path) -> ModelDims:
    """The architecture facts the DDMA planner needs, from the HF config (no weights)."""
    from megarl.models.layouts import ModelDims
    from megarl.trainer.model import read_hf_config

    return ModelDims.from_hf_config(read_hf_config(model_dir))


def resolved_sync(cfg: MegaRLConfig, devices: DevicePlan | None = None):
    """``cfg.sync`` with ``transport`` resolved (auto / p2p -> the transport this job uses, megarl.ddma.transport)
    and ``probe_max_gap`` 0 replaced by the bound for the coarsest of the trainer's weights, the DDMA wire and
    the engine. With ``devices`` (this job's GPUs) a one-host CUDA job asks whether its trainer and generator
    GPUs have peer access, which CUDA IPC needs: auto picks nccl without it, and an explicit cuda_ipc is
    refused naming the fix."""
    import dataclasses

    from megarl.config.validate import cuda_expected
    from megarl.controller.weight_sync import default_probe_gap
    from megarl.ddma.transport import choose_transport
    from megarl.ddma.transport.choice import transport_problem
    from megarl.utils.devices import cuda_peer_access

    device = "cuda" if cuda_expected(cfg.cluster.device) else "cpu"
    same_host = cfg.cluster.launcher == "local"
    gap = cfg.sync.probe_max_gap or default_probe_gap(cfg.generator.dtype, cfg.generator.quantization,
                                                      cfg.trainer.params_dtype,
                                                      cfg.sync.wire if cfg.sync.method == "ddma" else "engine")
    peer = None
    if (device == "cuda" and same_host and cfg.sync.method == "ddma" and cfg.sync.transport in ("auto", "cuda_ipc")
            and devices is not None and devices.trainer and devices.generator):
        peer = cuda_peer_access([(t, g) for t in set(devices.trainer) for g in set(devices.generator)])
        if peer is False:
            problem = transport_problem(cfg.sync.transport, device=device, same_host=same_host, peer_access=peer)
            if problem:
                raise ConfigError([problem])
            log.warning("weight sync: the trainer's and the generator's GPUs have no CUDA peer access, which CUDA "
                        "IPC needs: sync.transport=auto picks nccl")
    return dataclasses.replace(cfg.sync, probe_max_gap=gap, transport=choose_transport(
        cfg.sync.transport, device=device, same_host=same_host, peer_access=peer))


def describe_sync(cfg: MegaRLConfig, sync=None) -> str:
    """One line for the log: how the weights travel and how often they are proven (``sync``: the resolved
    ``cfg.sync``, :func:`resolved_sync`'s, when the job has it)."""
    s = cfg.sync
    if s.method == "shm":
        return "full HF tensors through one shared-memory file (sync.method=shm)"
    chosen = (sync or resolved_sync(cfg)).transport
    how = chosen if chosen == s.transport else f"{chosen} (sync.transport={s.transport})"
    return (f"DDMA {how}, wire {s.wire}, checksums every {s.verify_every or 'never'} sync(s), "
            f"logprob probe every {s.probe_every or 'never'}")


def _announce_native(mode: str) -> None:
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


def resolve_model(path: str) -> Path:
    """An HF folder for ``model.path``: a folder, an HF id's snapshot in the local HF cache, or the
    built-in SmolLM2 (converted once and cached)."""
    if path == BUILTIN_SMOLLM2:
        from megarl.models.smollm2 import ensure_smollm2_hf

        log.info("preparing the built-in SmolLM2-135M-Instruct (first time: converts the GGUF, ~1 min)")
        return ensure_smollm2_hf()
    from megarl.config.model_source import local_model_dir

    return local_model_dir(path) or Path(path)  # an HF id: its snapshot in the local HF cache


def place_devices(cfg: MegaRLConfig) -> DevicePlan:
    """Each executor's GPUs (megarl.config.placement); a layout that does not fit is a ConfigError."""
    visible = 0
    if cfg.cluster.device != "cpu":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        plan = device_plan(cfg, visible)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    log.info("placement: %s", plan.note)
    return plan


def _select_device(device: str) -> None:
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


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("megatron", "vllm", "transformers"):  # their INFO is per-parameter detail
        logging.getLogger(noisy).setLevel(logging.WARNING)
