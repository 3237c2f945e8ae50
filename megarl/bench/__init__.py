"""Benchmarks: ``megarl bench <name> [args]`` runs ``python -m megarl.bench.<name> [args]``.

Each bench is a module of this package with a ``main()``; ``BENCHES`` names them with one line each
(what ``megarl bench --help`` lists). They ship with the package, so an installed megarl runs them
without a source checkout; a bench that reads a config (``step``, ``checkpoint``) takes its path as
the first argument (the default, ``configs/bench_step.yaml``, is a checkout's, relative to the
folder it runs in). Helpers that are not benches (``sync_landing``, ``shape``) are not listed.

``slurm`` is not here: it drives a real Slurm cluster built by the test harness, so it stays a
checkout tool (``tools/bench_slurm.py``), which ``megarl bench slurm`` runs from a checkout.

Nothing in megarl imports this package but ``megarl.cli``.
"""

from __future__ import annotations

BENCHES = {
    "step": "one config's step, sync vs async, side by side (real `megarl train` jobs)",
    "trainer": "megarl's training step vs a bare Megatron step on the same model and batch",
    "generator": "the generator executor (vLLM) vs raw vLLM and transformers on the same prompts",
    "sync": "DDMA weight sync vs gather+broadcast and the shm push, on equal work",
    "checkpoint": "the step with and without trainer.async_save",
    "startup": "a job's start-up: trainer and generator one after the other vs together",
    "reward": "sandboxed code rewards: rewards/s, p50/p99 latency, the timeout share",
    "prox": "A-3PO's approximated proximal policy vs decoupled PPO's recompute forward",
    "packing": "sequence packing and token-budget micro-batches vs right-padded rows",
    "lora": "LoRA vs full fine-tuning: the trainer step and the DDMA sync (bytes, seconds)",
    "fast_paths": "the paths that should be fast (layouts, plans, CLI start-up), against their budgets",
    "merge_runs": "C++ merge_contiguous_runs vs its pure-Python reference",
}
CHECKOUT_ONLY = {"slurm": "tools/bench_slurm.py"}  # needs the test harness's Slurm cluster: a source checkout
