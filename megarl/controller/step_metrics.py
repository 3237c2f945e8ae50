"""One step's row of metrics.jsonl: the trainer's, phase times, busy/idle, sync, lag, what the scored
samples look like (reward and the signs of a hacked reward), and the data stream's CRC."""

from __future__ import annotations

from megarl.controller.rollouts import prompts_crc32
from megarl.rollout import Sample


def step_metrics(train: dict[str, float], times: dict[str, float], busy: dict[str, float], sync: dict[str, float],
                 lag: dict[str, float], samples: list[Sample], prompt_ids: list[list[int]]) -> dict[str, float]:
    """One step's row of metrics.jsonl: the trainer's (``train/*``), phase times, busy/idle, sync,
    lag, what the samples look like, and the data stream's CRC (a resumed run continues it)."""
    gen_seconds = busy["exec/generator_busy_s"] or lag["gen/batch_latency_s"]
    return {**{(k if k.startswith("model/") else f"train/{k}"): v for k, v in train.items()}, **times, **busy, **sync, **lag,
            **rollout_metrics(samples, gen_seconds), "data/prompts_crc32": prompts_crc32(prompt_ids)}


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


__all__ = ["rollout_metrics", "step_metrics"]
