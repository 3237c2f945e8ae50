"""The distillation teacher (issue 43): a forward-only Megatron executor (megarl/teacher/executor.py)."""
