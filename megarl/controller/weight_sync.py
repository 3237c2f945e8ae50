"""The controller's one weight-sync call: trainer -> generator, then proof that the weights arrived.

``sync.method=ddma`` (default): the controller hosts the rendezvous store and hands both sides a
:class:`megarl.ddma.sync.SyncSpec`; every trainer rank sends its own shards (``trainer.start_sync``)
while every generator worker receives and lands only its shard (``update_weights_from_source``).
The controller holds no weights. ``sync.method=shm``: the single-rank trainer assembles full HF
tensors and the generator maps them from one shared-memory file (the path before DDMA).

Proof: DDMA checksums every destination slice every ``sync.verify_every`` syncs, the receiver's
taken on the engine's parameters as they landed (a mismatch raises on the worker and stops the
job). At the first sync, always, and then every ``sync.probe_every`` syncs, a logprob probe
generates greedily from a fixed prompt and compares the engine's logprobs with the trainer's on the
same tokens. The default bound (``sync.probe_max_gap=0``) follows the coarsest of the trainer's
weights, the DDMA wire (``sync.wire``) and the engine:

- float32: 1e-3 nats. Measured engine-vs-trainer mismatch is < 1e-4 (tests/e2e/test_controller.py); 10x margin.
- bfloat16 / float16 (engine or trainer weights): 0.25 nats. The largest bf16 engine-vs-reference gap
  measured is 0.062, on an AMX CPU (DESIGN.md "Numerics"); 4x margin. A bf16 trainer (bf16 matmuls, fp32
  master weights) against an fp32 engine holding the same bf16-valued weights: 0.124 measured on
  SmolLM2-135M, AMX CPU (the quickstart's first probe); 2x margin.
- FP8 weights (the engine's quantization, or ``sync.wire=fp8``: the engine then holds e4m3-rounded values,
  even an fp32 one): 1.0 nats. e4m3 keeps 3 mantissa bits, so each weight errs by up to 2^-4 relative, and
  this bound only catches gross errors. Measured with wire fp8 into an fp32 engine at v0: 0.42 nats on the
  tiny test model (tests/e2e/test_weight_sync.py), 0.30 in the run that the fp32 bound stopped; 2.4x margin.

A wrong layout scrambles the weights, and a real model's logprobs then move by many nats. (A random
tiny test model's logits are nearly uniform, so use perturbed weights to test the probe.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from typing import TYPE_CHECKING

from megarl.ddma.config import SyncConfig, default_probe_gap

if TYPE_CHECKING:
    from megarl.executors.base import Generator, Trainer
    from megarl.generator.config import GeneratorConfig
    from megarl.models.layouts import ModelDims

log = logging.getLogger("megarl")

PROBE_TOKENS = 16


class ProbeMismatch(RuntimeError):
    """The generator's logprobs on the probe prompt are not the trainer's: its weights are wrong."""


def probe_due(sync_number: int, probe_every: int) -> bool:
    """Whether the ``sync_number``-th sync of this process (1 = the first) is probed: the first
    always (a wrong landing must stop the job before a single step trains on it), then every
    ``probe_every``-th after it (0: none after the first)."""
    return sync_number == 1 or (probe_every > 0 and (sync_number - 1) % probe_every == 0)


class DdmaPush:
    """``sync.method=ddma``: every trainer rank sends its own shards straight to the generator
    workers that need them (megarl/ddma/); the controller only hosts the rendezvous store.
    ``cfg.transport`` comes resolved (controller/loop.py ``resolved_sync``): SyncSpec refuses an alias."""

    def __init__(self, cfg: SyncConfig, trainer: Trainer, generator: Generator, *, dims: ModelDims,
                 generator_cfg: GeneratorConfig):
        from megarl.ddma.layouts import GeneratorTopology
        from megarl.ddma.sync import SyncSpec, host_store

        self.trainer, self.generator = trainer, generator
        self._store = host_store()  # kept alive: workers and trainer ranks rendezvous here
        # Trainer ranks on other nodes (megarl.cluster) reach the store at the controller's address.
        store_host = os.environ.get("MEGARL_CONTROLLER_ADDR", "127.0.0.1")
        self.spec = SyncSpec(dims, trainer.topology(), GeneratorTopology(generator_cfg.tp, generator_cfg.replicas),
                             store_host, self._store.port, transport=cfg.transport, wire=cfg.wire,
                             engine_dtype=generator_cfg.dtype, verify_every=cfg.verify_every,
                             timeout_s=cfg.timeout_s, bucket_bytes=cfg.bucket_mb << 20)

    def push(self, version: int) -> dict[str, float]:
        self.trainer.start_sync(self.spec, version)
        try:
            self.generator.update_weights_from_source(self.spec.weight_source(version), version,
                                                      peer_check=self.trainer.raise_if_dead)
        except BaseException as e:
            # The receivers failed mid-sync. The senders would wait for them until the sync's
            # timeout and hide the cause (measured: 6 min): the trainer stops them now.
            self.trainer.abandon_sync(f"the generator failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            raise
        ranks = self.trainer.finish_sync()
        return self._metrics(ranks, version)

    def push_to_replica(self, replica: int, version: int) -> None:
        """A sync to one (restarted) generator replica alone: a topology of that one replica, on a
        rendezvous store of its own (store keys name only the version, which the full sync of
        ``version`` already used), always checksummed."""
        from megarl.ddma.layouts import GeneratorTopology
        from megarl.ddma.sync import host_store

        self._restore_store = host_store()  # kept alive until the next restore replaces it
        spec = dataclasses.replace(self.spec, dst=GeneratorTopology(self.spec.dst.tp, 1),
                                   store_port=self._restore_store.port, verify_every=1)
        self.trainer.start_sync(spec, version)
        try:
            self.generator.update_weights_from_source({**spec.weight_source(version), "replica": 0}, version,
                                                      peer_check=self.trainer.raise_if_dead, replicas=[replica])
        except BaseException as e:
            self.trainer.abandon_sync(f"generator replica {replica} failed while restoring its weights: "
                                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
            raise
        self.trainer.finish_sync()

    def _metrics(self, ranks: list[dict], version: int) -> dict[str, float]:
        from megarl.ddma.sync import verified_workers

        return {"sync/bytes_sent": float(sum(r["bytes_sent"] for r in ranks)),
                "sync/sender_transfer_s": max(r["transfer_s"] for r in ranks),
                "sync/sender_quantize_s": max(r["quantize_s"] for r in ranks),
                "sync/sender_verify_s": max(r["verify_s"] for r in ranks),
                # the share of generator workers whose landing matched the senders' checksums (set
                # by each worker after its compare passed: 0 when this sync was not checksummed)
                "sync/verified": verified_workers(self._store, self.spec, version) / len(self.spec.dst.ranks())}


class ShmPush:
    """``sync.method=shm``: the single-rank trainer assembles full HF tensors and every generator
    worker reads them from one shared-memory file through vLLM's own loaders (the path before DDMA)."""

    def __init__(self, cfg: SyncConfig, trainer: Trainer, generator: Generator, **_: object):
        self.trainer, self.generator = trainer, generator

    def push(self, version: int) -> dict[str, float]:
        self.generator.update_weights(self.trainer.hf_weights(), version=version)
        return {}

    def push_to_replica(self, replica: int, version: int) -> None:
        """The weights to one (restarted) generator replica alone."""
        self.generator.update_weights(self.trainer.hf_weights(), version=version, replicas=[replica])


STRATEGIES: dict[str, type] = {"ddma": DdmaPush, "shm": ShmPush}  # sync.method -> its push


class WeightSync:
    """``push(version)`` moves the trainer's weights into every generator engine (the strategy of
    ``sync.method``) and proves they arrived (the logprob probe). ``quiesce``
    (controller.deterministic): let every round in flight finish under the old weights first."""

    def __init__(self, cfg: SyncConfig, trainer: Trainer, generator: Generator, *, dims: ModelDims,
                 generator_cfg: GeneratorConfig, probe_prompt: list[int], pad_id: int = 0, quiesce: bool = False):
        self.cfg, self.trainer, self.generator = cfg, trainer, generator
        self.quiesce = quiesce  # controller.deterministic: weights change only when no round is in flight
        self.probe_prompt, self.pad_id = list(probe_prompt), pad_id
        # the job resolved the bound (config/job.py resolved_sync); an unresolved config (tests) gets the default
        self.max_gap = cfg.probe_max_gap or default_probe_gap(generator_cfg.dtype, generator_cfg.quantization,
                                                              wire=cfg.wire if cfg.method == "ddma" else "engine")
        self.strategy = STRATEGIES[cfg.method](cfg, trainer, generator, dims=dims, generator_cfg=generator_cfg)
        self.syncs = 0
        if hasattr(generator, "set_weight_restorer"):  # a restarted replica gets its weights here
            generator.set_weight_restorer(self.restore_replica)

    def push(self, version: int) -> dict[str, float]:
        """Sync weights ``version`` to the generator; returns ``sync/*`` metrics."""
        t0 = time.monotonic()
        if self.quiesce:  # before the senders start: their wait (sync.timeout_s) must not cover it
            self.generator.drain()
        if hasattr(self.generator, "recover_failed"):  # a replica restore is a sync of its own: before this one
            self.generator.recover_failed()
        out = self.strategy.push(version)
        self.syncs += 1
        if probe_due(self.syncs, self.cfg.probe_every):
            out["sync/probe_gap"] = self.probe(version)
        out["sync/total_s"] = time.monotonic() - t0
        out["gen/replica_restarts"] = float(getattr(self.generator, "restarts", 0))  # so far in this process
        return out

    def restore_replica(self, replica: int) -> int:
        """Generator supervision (megarl/generator/supervision.py): a restarted replica gets the
        trainer's weights, a sync to it alone, checksummed and probed on that replica; returns their
        version. The generator calls it while the controller waits on it, so the trainer is idle and
        holds the weights of ``trainer.step_count``: the version the other replicas hold, or with
        sync.every > 1 a newer one (the restarted replica's tokens then carry that newer version)."""
        version = self.trainer.step_count
        t0 = time.monotonic()
        self.strategy.push_to_replica(replica, version)
        gap = self.probe(version, replica=replica)
        log.info("sync v%d to restarted generator replica %d alone: %.2fs, probe gap %.2e nats", version, replica,
                 time.monotonic() - t0, gap)
        return version

    def probe(self, version: int, replica: int | None = None) -> float:
        """Greedy tokens from the probe prompt (``replica``: on that one); max |generator - trainer|
        logprob over them (nats). Raises ProbeMismatch over the bound."""
        from megarl.batch import RolloutBatch

        where = {} if replica is None else {"replica": replica}
        samples = self.generator.generate([self.probe_prompt], n_samples=1, max_new_tokens=PROBE_TOKENS,
                                          sampling={"temperature": 0.0}, **where)
        batch = RolloutBatch.from_samples(samples, pad_id=self.pad_id)
        lp = self.trainer.logprobs(batch, temperature=1.0)  # greedy reports the untempered distribution
        gap = float(((lp - batch.behav_logprobs).abs() * batch.loss_mask).max())
        if gap > self.max_gap:
            raise ProbeMismatch(
                f"weight sync v{version}: the generator's logprobs on the probe prompt differ from the trainer's by "
                f"{gap:.4f} nats (> sync.probe_max_gap {self.max_gap}); the engine does not hold the trainer's "
                f"weights (a wrong layout or a lost update). Stopping.")
        log.info("sync v%d: logprob probe gap %.2e nats (bound %.2g)", version, gap, self.max_gap)
        return gap


__all__ = ["WeightSync", "DdmaPush", "ShmPush", "STRATEGIES", "ProbeMismatch", "probe_due"]
