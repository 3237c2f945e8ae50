"""Prompt sources: GSM8K-format jsonl files and procedural arithmetic."""

from megarl.data.tasks import Task, format_prompt, load_tasks, split_train_eval

__all__ = ["Task", "format_prompt", "load_tasks", "split_train_eval"]
