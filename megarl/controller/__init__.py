"""The controller: the RL loop (``loop.py``), its prompt stream (``prompts.py``), the strict held-out
evaluation (``evaluation.py``) and the run folder people read (``run.py``)."""

from megarl.controller.loop import run_job

__all__ = ["run_job"]
