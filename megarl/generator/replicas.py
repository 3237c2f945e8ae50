"""The generator executor's bookkeeping of its replicas: one sample's rounds (:class:`Track`), one
replica process, spawned here or attached from another node (:class:`ReplicaHandle`), and the
shared-memory files a replica may leave behind."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.executors.attach import RemoteProcess
from megarl.rollout import Sample


@dataclasses.dataclass
class Track:
    """One sample being generated, possibly over several rounds."""

    key: str
    group_id: int
    sample_index: int
    prompt_index: int
    prompt_ids: list[int]
    max_new_tokens: int
    round_budget: int = 0
    sampling: dict = dataclasses.field(default_factory=dict)
    seed_key: str = ""  # deterministic mode: what its per-request seeds derive from (request_seed)
    replica: int = -1
    rounds: int = 0
    ids: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    vers: list[int] = dataclasses.field(default_factory=list)
    # MoE: per token of prompt_ids + ids, per MoE layer, the top-k expert ids of the latest round that
    # ran it (-1 = none did); [] = not reported (a dense model)
    experts: list = dataclasses.field(default_factory=list)

    def sample(self, finish_reason: str, stop_reason: Any) -> Sample:
        routed = None
        if self.experts:
            n = len(self.prompt_ids) + len(self.ids)
            fill = [[-1] * len(self.experts[0][0]) for _ in self.experts[0]]
            routed = [list(map(list, e)) for e in self.experts[:n]] + [fill] * max(n - len(self.experts), 0)
        return Sample(routed_experts=routed,prompt_ids=list(self.prompt_ids), completion_ids=list(self.ids),
                      behav_logprobs=list(self.lps), versions=list(self.vers),
                      finish_reason=finish_reason, group_id=self.group_id,
                      sample_index=self.sample_index, prompt_index=self.prompt_index,
                      stop_reason=stop_reason, num_rounds=self.rounds)


class ReplicaHandle:
    def __init__(self, index: int, process, conn, log_path: Path):
        self.index = index
        self.process = process
        self.remote = isinstance(process, RemoteProcess)  # attached from another node, not spawned here
        self.conn = conn
        self.log_path = log_path
        self.active: set[str] = set()  # rids in flight on this replica
        self.info: dict = {}
        # when it last sent anything (or was given work while idle): supervision's frozen clock
        self.last_heard = time.monotonic()

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def remove_shm_files(prefixes: Sequence[str]) -> None:
    for prefix in prefixes:
        if not prefix or "/" in prefix:
            continue
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass


def request_seed(seed: int, t: Track) -> int:
    """The seed of ``t``'s next round (deterministic mode): a function of generator.seed, the
    sample's seed key and index, and how many tokens it has, never of timing or batching; a sample
    submitted without a key (evaluation, the probe) is keyed by its prompt."""
    key = t.seed_key or f"prompt:{zlib.crc32(repr(t.prompt_ids).encode())}"
    return zlib.crc32(f"{seed}|{key}|{t.sample_index}|{len(t.ids)}".encode())


_VOCAB: dict[str, int] = {}  # model folder -> config.json vocab_size


def model_vocab_size(model_dir: str) -> int:
    """config.json's vocab_size (0 when absent): the token ids a replica's engine accepts."""
    if model_dir not in _VOCAB:
        _VOCAB[model_dir] = int(json.loads((Path(model_dir) / "config.json").read_text()).get("vocab_size") or 0)
    return _VOCAB[model_dir]


__all__ = ["ReplicaHandle", "Track", "model_vocab_size", "remove_shm_files", "request_seed"]
