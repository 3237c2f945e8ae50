"""The controller: the one place the RL loop is written.

Each step: keep up to ``max_policy_lag`` later batches generating (controller/rollouts.py), take this
step's rollouts, score them, keep the groups whose rewards vary (algorithm.dynamic_sampling, refilling
from further prompts: controller/dynamic_sampling.py), train, sync the weights. With ``max_policy_lag: 0`` that is the
synchronous on-policy baseline; with ``k > 0`` the generator works on the next batches while the
trainer trains (LlamaRL-style, 1..k versions of lag, corrected by the loss). The trainer's TP x PP x DP
Megatron ranks and the generator's vLLM replicas run in their own processes; weights travel by DDMA
(controller/weight_sync.py), each worker receiving only its shard, checksummed and probed.

Beside the loop, not inside it: the resolved job (config/job.py: model folder, devices, sync, resume
folder), the process set-up and the executors' start (controller/startup.py), checkpoints and resume
(controller/checkpointing.py, controller/state.py), the run folder (controller/run.py), a step's metrics
(controller/step_metrics.py), busy/idle and the run summary (controller/summary.py).

A new role (critic, judge, teacher) is started in startup.start_executors and plugs into ``train`` as one
call in the step: a judge's scores in ``score`` (rollout_scorer), a teacher's logprobs on the train batch
before ``trainer.step``, a critic's per-token advantages before it and the critic's own update after it.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING

from megarl.config import ConfigError
from megarl.config.job import ResolvedJob, describe_sync, resolve_job
from megarl.config.job import resolved_sync  # noqa: F401 (named here for tests/e2e/test_weight_sync.py)
from megarl.config.schema import MegaRLConfig
from megarl.controller.checkpointing import checkpoint, checkpoint_on_preemption, resume_controller
from megarl.controller.dynamic_sampling import DynamicSampling
from megarl.controller.evaluation import EvalResult, StrictScorer
from megarl.controller.prompts import PromptSource
from megarl.controller.rollouts import RolloutQueue, trained_record
from megarl.controller.run import RunFolder, claim_run_folder, close_finished_run
from megarl.controller.staleness import push_due
from megarl.controller.state import run_checkpoint_root
from megarl.controller.startup import (controller_log_path, model_dims, prepare_process,
                                       setup_logging, start_executors)
from megarl.controller.step_metrics import step_metrics
from megarl.controller.summary import ExecutorActivity
from megarl.executors.base import Generator, RewardScorer, Trainer
from megarl.rollout import Sample
from megarl.utils.faults import pause_point
from megarl.utils.metrics import PhaseTimer
from megarl.utils.procs import Preemption, signals_raise

if TYPE_CHECKING:  # these import (or may import) torch, which must wait until startup.prepare_process has run
    from megarl.controller.turns import EnvironmentTurns
    from megarl.controller.weight_sync import WeightSync
    from megarl.critic.executor import CriticExecutor
    from megarl.teacher.executor import TeacherExecutor

log = logging.getLogger("megarl")


def run_job(cfg: MegaRLConfig) -> int:
    """Run the job described by ``cfg``; returns a process exit code. Its log is also written to
    ``<run folder>/logs/controller.log``, with the full traceback of whatever ends it
    (megarl.utils.errors: the console gets one line naming that file)."""
    from megarl.utils.errors import command_log

    setup_logging()
    with command_log(controller_log_path(cfg)):
        return _run_job(cfg)


def _run_job(cfg: MegaRLConfig) -> int:
    prepare_process(cfg)  # cluster.device before torch is imported, one NCCL setting for the job
    resume_dir = claim_run_folder(cfg)  # resume (said first, with the step) or start over, never mixing two runs
    if resume_dir is not None and close_finished_run(cfg, resume_dir):  # a finished run: nothing starts
        return 0
    job = resolve_job(cfg, resume_dir)  # frozen before any executor holds a GPU
    from megarl.controller.weight_sync import WeightSync

    prompts = PromptSource(cfg, job.model_dir)
    with ExitStack() as stack:
        # First in, last out: SIGTERM/SIGINT/SIGHUP raise JobInterrupted here, the stack closes
        # every executor below, then the handlers are restored (megarl.utils.procs).
        # Once the loop runs, SIGTERM (a plain run: also the first SIGINT) checkpoints before the job
        # exits, within cluster.preempt_grace_s; under a launcher it then exits for a requeue
        # (PREEMPTED_EXIT), a plain run with 128 + signum; a second signal exits a plain run at once.
        preempt = Preemption(requeue=cfg.cluster.launcher == "slurm", grace_s=cfg.cluster.preempt_grace_s,
                             checkpoints=run_checkpoint_root(cfg))  # read when the grace time runs out
        stack.enter_context(signals_raise(preemption=preempt))
        run = stack.enter_context(RunFolder(cfg, n_eval=len(prompts.held)))
        ex = start_executors(cfg, job, stack, run)
        weights = WeightSync(job.sync, ex.trainer, ex.generator, dims=model_dims(job.model_dir),
                             generator_cfg=cfg.generator, probe_prompt=prompts.eval_set()[1][0], pad_id=prompts.pad_id,
                             quiesce=cfg.controller.deterministic)
        log.info("weight sync: %s", describe_sync(cfg, job.sync))
        train(cfg, job, run, prompts, ex.trainer, ex.generator, ex.reward, weights, preempt, teacher=ex.teacher,
              critic=ex.critic)
        run.finish(cfg.controller.steps)
    return 0


def train(cfg: MegaRLConfig, job: ResolvedJob, run: RunFolder, prompts: PromptSource, trainer: Trainer,
          generator: Generator, reward: RewardScorer, weights: WeightSync, preempt: Preemption | None = None, *,
          teacher: TeacherExecutor | None = None, critic: CriticExecutor | None = None) -> None:
    """The RL loop. Each step: keep up to ``max_policy_lag`` later batches generating, take this
    step's rollouts, score them, keep the groups whose rewards vary (dynamic sampling: refilled from
    further prompts), train, sync the weights; evaluate and checkpoint on schedule. A
    preemption abandons the generation wait, or lets a step past it finish, then checkpoints."""
    from megarl.batch import RolloutBatch
    from megarl.teacher.executor import distill_metrics
    from megarl.trainer.checkpoint_index import should_save

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
    resume_controller(cfg, run, trainer.step_count, job.resume_dir, rollouts, sampling)
    activity = ExecutorActivity(generator)
    turns = environment_turns(cfg, generator, prompts)  # None: single turn, each reply scored by reward.fn
    preempt = preempt or Preemption()
    with checkpoint_on_preemption(cfg, trainer, rollouts, preempt, saved=trainer.step_count, critic=critic):
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
                advantages = None if critic else group_advantages(cfg, samples, [s.reward for s in samples])
                train_batch = RolloutBatch.from_samples(samples, advantages, pad_id=prompts.pad_id)
                if teacher:  # algorithm.teacher: its logprobs of the sampled tokens (distillation's reverse KL)
                    with timer.phase("teacher"):
                        train_batch = teacher.fill(train_batch)
                if critic:  # gae/vtrace: per-token advantages from the critic's values of the batch
                    with timer.phase("critic"):
                        train_batch, critic_update = critic.advantages(train_batch, [s.reward for s in samples], trainer)
                with timer.phase("train"):
                    train_metrics = trainer.step(train_batch)
                critic_metrics = {}
                if critic:  # then the critic learns the returns its values gave
                    with timer.phase("critic"):
                        critic_metrics = critic.step(critic_update)
                with timer.phase("sync"):  # sync.every: after steps K, 2K, ... and the last (staleness.push_due)
                    pushed = push_due(step, steps, cfg.sync.every)
                    sync_metrics = weights.push(trainer.step_count) if pushed else {}
                    held = trainer.step_count if pushed else held
                sync_metrics.update({"sync/pushed": float(pushed), "sync/generator_version": float(held)})
                times = timer.finish()
                metrics = step_metrics(train_metrics, times, activity.end(times), sync_metrics, batch.lag_metrics,
                                       samples, batch.prompt_ids)
                metrics.update(distill_metrics(train_metrics))  # distill/reverse_kl, with a teacher
                metrics.update(critic_metrics)  # critic/value_loss, critic/explained_var, critic/clip_frac, ...
                metrics.update(reward_counts)  # reward/timeouts, reward/errors (samples), reward/worker_deaths
                metrics.update(batch_metrics)  # batch/dropped_groups, batch/refill_rounds, batch/padded_groups
                run.log_samples(step, [trained_record(s) for s in samples])
                sampling.log(sampling_record)
                if every and (step % every == 0 or step == steps):
                    metrics.update(evaluate(generator, prompts, run, step=step))
                if should_save(cfg.trainer, step, steps):  # the row goes with it: a kill before run.log loses no row
                    metrics["checkpoint/seconds"] = checkpoint(cfg, trainer, rollouts, critic, metrics_row=metrics)
                run.log(step, steps, metrics)
            pause_point(f"step_logged@{step}", until=lambda: preempt.requested)  # fault tests: a signal here
                                                                               # lands between two steps
        with preempt.deferred():
            trainer.wait_saves()  # trainer.async_save: the last checkpoint is complete before the job ends


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
                            max_model_len=g.max_model_len, truncated_score=r.wrong if r.truncated is None else r.truncated,
                            step_timeout_s=r.env_step_timeout_s)


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
