"""The ``critic:`` knobs: the value model gae/vtrace need (algorithm.advantage; megarl/critic/).

Torch-free, like every config section: the top-level config's ``critic:`` section (megarl/config/schema.py),
read only when algorithm.advantage is gae or vtrace; the critic's executor (megarl/critic/executor.py)
runs its ranks at :meth:`CriticConfig.layout` and its learner (megarl/critic/learner.py) takes the rest.
"""

from __future__ import annotations

import dataclasses
from typing import List

from megarl.utils.knobs import knob


@dataclasses.dataclass
class CriticConfig:
    path: str = knob("", help="the value model's starting weights: an HF folder or a megarl Megatron checkpoint "
                     "of the policy's architecture (a scalar head replaces the vocabulary projection); "
                     "default '' = the policy's weights (model.path)")
    lr: float = knob(1.0e-5, help="the critic's peak learning rate (per update, AdamW; its own optimizer, the "
                     "trainer's schedule knobs); default 1e-5 (verl's critic default, 10x the policy's 1e-6)")
    value_clip: float = knob(0.2, help="PPO value clip: a value moves at most this far from the one the step's "
                             "advantages used (reward units, > 0); 0 = no clip; default 0.2")
    micro_batch_size: int = knob(0, help="sequences per critic forward/backward on one DP rank (count, >= 0); "
                                 "default 0 = trainer.micro_batch_size")
    head_init_std: float = knob(0.0, help="std of the scalar head's initial weights (dimensionless, >= 0); "
                                "default 0: every value starts at 0")
    tp: int = knob(0, help="the critic's tensor-parallel size (ranks, >= 0; a divisor of the model's heads like "
                   "trainer.tp); default 0 = trainer.tp")
    pp: int = knob(0, help="the critic's pipeline-parallel size (stages, >= 0); default 0 = trainer.pp")
    dp: int = knob(0, help="the critic's data-parallel size (ranks, >= 0; a step's batch, and each of its "
                   "trainer.minibatches, must split over it); default 0 = trainer.dp")
    checkpoint_subdir: str = knob("critic", help="folder under the trainer's checkpoint folder that holds the "
                                  "critic's checkpoints (saved and resumed with the trainer's); default 'critic'")

    def problems(self) -> List[str]:
        """Every invalid value, each naming the key and what to change (empty when valid)."""
        out = []
        if not self.lr > 0:
            out.append(f"critic.lr={self.lr}: must be > 0 (the critic's learning rate)")
        if self.value_clip < 0:
            out.append(f"critic.value_clip={self.value_clip}: must be >= 0 (reward units; 0 = no clip)")
        if self.micro_batch_size < 0:
            out.append(f"critic.micro_batch_size={self.micro_batch_size}: must be >= 0 (0 = the trainer's)")
        for key in ("tp", "pp", "dp"):
            if getattr(self, key) < 0:
                out.append(f"critic.{key}={getattr(self, key)}: must be >= 0 (0 = the trainer's)")
        if self.head_init_std < 0:
            out.append(f"critic.head_init_std={self.head_init_std}: must be >= 0")
        if not self.checkpoint_subdir or "/" in self.checkpoint_subdir or self.checkpoint_subdir.startswith("."):
            out.append(f"critic.checkpoint_subdir={self.checkpoint_subdir!r}: must be one folder name (e.g. critic)")
        return out

    def layout(self, trainer) -> tuple[int, int, int]:
        """(tp, pp, dp) of the critic's ranks: its own sizes, the trainer's where 0."""
        return self.tp or trainer.tp, self.pp or trainer.pp, self.dp or trainer.dp

    def ranks(self, trainer) -> int:
        """The critic's rank count (one process, and on GPUs one device, each)."""
        tp, pp, dp = self.layout(trainer)
        return tp * pp * dp
