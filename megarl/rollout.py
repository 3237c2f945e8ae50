"""One generated sample, as the generator hands it to the controller, reward and trainer."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Sample:
    """A prompt and one completion, with what importance weighting needs per token.

    prompt_ids:     the prompt's token ids, exactly as fed to the generator.
    completion_ids: generated token ids (a stop string's tokens are kept; EOS is kept).
    behav_logprobs: per completion token, the behaviour policy's logprob of that token given
                    everything before it (convention: see ``megarl.generator.config``).
    versions:       per completion token, the policy version whose weights produced it. A partial
                    rollout resumed after an update shows the switch (e.g. ``[3, 3, 3, 4, 4]``).
    finish_reason:  'stop' (EOS or a stop string), 'length' (max_new_tokens or max_model_len),
                    or 'abort'.
    group_id:       samples of the same prompt share it (GRPO groups).
    sample_index:   0..n_samples-1 within the group.
    prompt_index:   caller's index of the prompt (e.g. position in the submitted list).
    stop_reason:    the stop string or token id that ended it, if any.
    num_rounds:     generation rounds it took (> 1 for a resumed partial rollout).
    uid:            the controller's id once trained (``s<step>p<prompt>k<sample>``), '' before.
    loss_mask:      per completion token, 1 for a token the policy sampled and 0 for an
                    environment's observation token in a multi-turn rollout (its behav_logprob
                    is 0 and its version -1: never computed, never used); None = all sampled.
    turns:          replies the policy gave in this rollout (1 for single turn).
    routed_experts: MoE models only (None otherwise, or when the engine did not report them): per
                    token of ``token_ids`` (prompt + completion), per MoE layer (model order), the
                    top-k expert ids the engine routed it to, ``[tokens][moe_layers][topk]``; -1 = not
                    reported (the last token, which the engine never ran; prompt tokens a prefix-cache
                    hit skipped). It may cover only a prefix. A resumed partial rollout, and each
                    turn of a multi-turn rollout (whose request runs the context so far again),
                    keep the latest routing of each token (:func:`merge_rounds`). The trainer replays them (trainer.router_replay, megarl/trainer/router_replay.py).
    reward, correct, formatted: set by a scorer (``RewardScorer.score``), None before: the
                    reward trained on, whether the final answer is right, whether one could be
                    extracted in the expected format.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    group_id: int = 0
    sample_index: int = 0
    prompt_index: int = 0
    stop_reason: str | int | None = None
    num_rounds: int = 1
    uid: str = ""
    reward: float | None = None
    correct: bool | None = None
    formatted: bool | None = None
    loss_mask: list[int] | None = None
    turns: int = 1
    routed_experts: list[list[list[int]]] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.behav_logprobs) != n or len(self.versions) != n:
            raise ValueError(f"Sample: {n} completion tokens but {len(self.behav_logprobs)} logprobs and "
                             f"{len(self.versions)} versions; they must align one per token")
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"Sample: {n} completion tokens but {len(self.loss_mask)} loss-mask entries")
        if self.routed_experts is not None and len(self.routed_experts) > len(self.prompt_ids) + n:
            raise ValueError(f"Sample: {len(self.prompt_ids) + n} tokens but routed experts for "
                             f"{len(self.routed_experts)}; they align one per token of prompt + completion")

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by completion: the sequence the trainer scores."""
        return list(self.prompt_ids) + list(self.completion_ids)

    @property
    def truncated(self) -> bool:
        """Cut at its token limit (finish reason 'length'): it never finished its answer."""
        return self.finish_reason == "length"


def merge_rounds(old: list | None, new, length: int) -> list[list[list[int]]]:
    """A sample's routed experts after one more round or turn: ``new`` (its ``[positions, layers, k]``,
    positions from 0 of prompt + completion) overwrites ``old`` where it is known (>= 0), the rest
    stays; the result covers ``length`` tokens, -1 where neither knows."""
    new = np.asarray(new, dtype=np.int64)
    if new.ndim != 3:
        return old[:length] if old is not None else []
    out = np.full((length, new.shape[1], new.shape[2]), -1, dtype=np.int64)
    if old:
        o = np.asarray(old, dtype=np.int64)[:length]
        out[:o.shape[0]] = o
    n = min(new.shape[0], length)
    known = (new[:n] >= 0).all(-1, keepdims=True)
    out[:n] = np.where(known, new[:n], out[:n])
    return out.tolist()
