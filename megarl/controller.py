"""The controller: the one place the RL loop is written.

Today it runs the loop synchronously (generate -> reward -> train -> sync, no overlap: what
`max_policy_lag: 0` means) with a single-rank trainer in this process and the generator's vLLM
replicas in their own processes; weights travel as full HF tensors through host shared memory.
The asynchronous loop (staleness-bounded admission, overlap), multi-rank trainers and DDMA arrive
with their issues and slot in below `run_job` without changing its shape.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from megarl.config import ConfigError, to_dict
from megarl.config.schema import BUILTIN_SMOLLM2, MegaRLConfig

log = logging.getLogger("megarl")


def run_job(cfg: MegaRLConfig) -> int:
    """Run the job described by ``cfg``; returns a process exit code."""
    _setup_logging()
    _check_supported(cfg)
    run_dir = Path(cfg.logging.out_dir) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(__import__("yaml").safe_dump(to_dict(cfg), sort_keys=False))
    log.info("run folder %s", run_dir.resolve())

    from megarl.algorithms import advantage_params, compute_advantages
    from megarl.generator.executor import GeneratorExecutor
    from megarl.reward import MathReward
    from megarl.trainer.checkpoint import should_save
    from megarl.trainer.local import LocalTrainer
    from megarl.utils.metrics import MetricsLogger, PhaseTimer, phase_line, plot_metrics

    model_dir = resolve_model(cfg.model.path)
    prompts = PromptSource(cfg, model_dir)
    steps = cfg.controller.steps
    trainer = generator = reward = metrics_log = None
    try:
        log.info("starting the trainer (Megatron, tp=pp=dp=1) from %s", model_dir)
        trainer = LocalTrainer(cfg.trainer, cfg.algorithm, model_dir, total_steps=steps, run_dir=run_dir)
        log.info("starting the generator (%d vLLM replica(s), tp=%d)", cfg.generator.replicas, cfg.generator.tp)
        generator = GeneratorExecutor(cfg.generator, model_dir).start()
        reward = MathReward(cfg.reward.workers, cfg.reward.timeout_s, cfg.reward.correct, cfg.reward.wrong)
        metrics_log = MetricsLogger(run_dir, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard)
        generator.update_weights(trainer.hf_weights(), version=trainer.step_count)  # resume-safe start
        if cfg.controller.eval_every and trainer.step_count == 0:  # the baseline the run improves on
            baseline = evaluate(generator, reward, prompts)
            metrics_log.log(0, {"eval/accuracy": baseline})
            log.info("step 0/%d (before training) | eval acc %.3f", steps, baseline)

        for step in range(trainer.step_count + 1, steps + 1):
            timer = PhaseTimer()
            tasks, prompt_ids = prompts.batch(step - 1, cfg.controller.prompts_per_step)
            with timer.phase("generate"):
                samples = generator.generate(prompt_ids)
            with timer.phase("reward"):
                golds = [tasks[s.prompt_index].answer for s in samples]
                rewards = reward.score([prompts.decode(s.completion_ids) for s in samples], golds)
            # generate() returns samples grouped by prompt, n_samples consecutive rows per group
            advantages = compute_advantages(cfg.algorithm.advantage, _tensor(rewards),
                                            group_size=cfg.generator.n_samples,
                                            **advantage_params(cfg.algorithm))
            with timer.phase("train"):
                train_metrics = trainer.step(prompts.rollout_batch(samples, advantages.tolist()))
            with timer.phase("sync"):
                generator.update_weights(trainer.hf_weights(), version=trainer.step_count)
            metrics = {**{f"train/{k}": v for k, v in train_metrics.items()}, **timer.finish(),
                       **_rollout_metrics(samples, rewards, timer.seconds["generate"])}
            if cfg.controller.eval_every and (step % cfg.controller.eval_every == 0 or step == steps):
                t0 = time.monotonic()
                metrics["eval/accuracy"] = evaluate(generator, reward, prompts)
                metrics["eval/seconds"] = time.monotonic() - t0
            if should_save(cfg.trainer, step, steps):
                metrics["checkpoint/seconds"] = _timed(trainer.save)
            metrics_log.log(step, metrics)
            if step % cfg.logging.log_every == 0 or step == steps:
                log.info(phase_line(step, steps, metrics))
        plot = plot_metrics(metrics_log.jsonl_path, run_dir / "metrics.png")
        log.info("done: %d steps; metrics in %s%s", steps, metrics_log.jsonl_path,
                 f", plot {plot}" if plot else "")
        return 0
    finally:
        for part in (metrics_log, reward, generator):
            if part is not None:
                (part.close if hasattr(part, "close") else part.shutdown)()
        if trainer is not None:
            trainer.close()


def evaluate(generator, reward, prompts: "PromptSource") -> float:
    """Greedy accuracy on the held-out prompts (never trained on)."""
    tasks, prompt_ids = prompts.eval_set()
    samples = generator.generate(prompt_ids, n_samples=1, sampling={"temperature": 0.0})
    scores = reward.score([prompts.decode(s.completion_ids) for s in samples], [t.answer for t in tasks])
    return sum(1.0 for s in scores if s == reward.correct) / max(len(scores), 1)


class PromptSource:
    """Tokenized training prompts in a fixed shuffled order, plus a disjoint held-out set."""

    def __init__(self, cfg: MegaRLConfig, model_dir: Path):
        from transformers import AutoTokenizer

        from megarl.data import format_prompt, load_tasks, split_train_eval

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        tasks = load_tasks(cfg.data.train_path, seed=cfg.data.seed)
        train, held = split_train_eval(tasks, 0 if cfg.data.eval_path else cfg.data.eval_size, seed=cfg.data.seed)
        if cfg.data.eval_path:
            held = load_tasks(cfg.data.eval_path, limit=cfg.data.eval_size)

        def encode(items):
            kept = [(t, self.tokenizer.encode(format_prompt(t, self.tokenizer, chat_template=cfg.data.chat_template),
                                              add_special_tokens=False)) for t in items]
            return [(t, ids) for t, ids in kept if len(ids) <= cfg.data.max_prompt_tokens]

        self.train, self.held = encode(train), encode(held)
        if not self.train:
            raise ConfigError([f"data.train_path={cfg.data.train_path!r}: no prompt fits "
                               f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        log.info("prompts: %d train, %d held-out", len(self.train), len(self.held))

    def batch(self, index: int, size: int):
        """The ``index``-th batch (deterministic, so a resumed run continues the same stream)."""
        rows = [self.train[(index * size + i) % len(self.train)] for i in range(size)]
        return [t for t, _ in rows], [ids for _, ids in rows]

    def eval_set(self):
        return [t for t, _ in self.held], [ids for _, ids in self.held]

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def rollout_batch(self, samples, advantages: list[float]):
        from megarl.trainer.batch import RolloutBatch

        return RolloutBatch.from_samples(samples, advantages, pad_id=self.pad_id)


def resolve_model(path: str) -> Path:
    """An HF folder for ``model.path`` (the built-in SmolLM2 is converted once and cached)."""
    if path == BUILTIN_SMOLLM2:
        from megarl.models.smollm2 import ensure_smollm2_hf

        log.info("preparing the built-in SmolLM2-135M-Instruct (first time: converts the GGUF, ~1 min)")
        return ensure_smollm2_hf()
    return Path(path)


def _check_supported(cfg: MegaRLConfig) -> None:
    t = cfg.trainer
    if t.tp * t.pp * t.dp != 1:
        raise ConfigError([f"trainer.tp={t.tp}, trainer.pp={t.pp}, trainer.dp={t.dp}: `megarl train` runs a "
                           f"single-rank trainer today (multi-rank trainers arrive with the controller); "
                           f"set all three to 1. Multi-rank training steps are exercised in tests/test_trainer_*"])
    if cfg.controller.max_policy_lag:
        log.warning("controller.max_policy_lag=%d: the asynchronous loop is not in yet; running synchronously "
                    "(on-policy, max_policy_lag 0)", cfg.controller.max_policy_lag)


def _tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.float32)


def _timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def _rollout_metrics(samples, rewards: list[float], gen_seconds: float) -> dict:
    tokens = sum(len(s.completion_ids) for s in samples)
    return {"reward/mean": sum(rewards) / max(len(rewards), 1), "gen/samples": len(samples),
            "gen/tokens": tokens, "gen/tokens_per_s": tokens / max(gen_seconds, 1e-9),
            "gen/mean_length": tokens / max(len(samples), 1),
            "gen/truncated_frac": sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1)}


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("megatron", "vllm", "transformers"):  # their INFO is per-parameter detail
        logging.getLogger(noisy).setLevel(logging.WARNING)
