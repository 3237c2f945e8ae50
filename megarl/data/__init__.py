"""Prompt sources: jsonl / json / parquet data in the seeds' row schemas (GSM8K, MATH, verl / DAPO, plain), and
procedural arithmetic."""

from megarl.data.tasks import Task, format_prompt, load_tasks, split_train_eval

__all__ = ["Task", "format_prompt", "load_tasks", "split_train_eval"]
