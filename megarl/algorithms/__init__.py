"""RL algorithms: off-policy policy losses, advantage estimators and the health metrics of async RL.

Pure torch functions over per-token ``[batch, seq]`` tensors; see docs/algorithms.md.
"""

__all__ = [
    "AlgorithmConfig", "LossInputs", "LossTerms", "a3po_alpha", "advantage_params", "aggregate",
    "centered_score_logprobs", "compute_advantages", "expand_to_tokens", "get_advantage", "get_loss",
    "group_stats", "importance_metrics", "kl_penalty", "known_advantages", "known_losses", "loss_knobs",
    "loss_params", "policy_loss", "register_advantage", "register_loss", "staleness_metrics", "to_floats",
]


# Imported lazily (PEP 562): `megarl.algorithms.config` must load without torch so config
# validation stays fast. The first use of anything else imports all the torch modules at once,
# which also registers every loss and advantage estimator.
def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'megarl.algorithms' has no attribute {name!r}")
    from megarl.algorithms.registry import (get_advantage, get_loss, known_advantages, known_losses,
                                            register_advantage, register_loss)
    from megarl.algorithms.losses import LossInputs, LossTerms, a3po_alpha
    from megarl.algorithms.advantages import advantage_params, compute_advantages, expand_to_tokens, group_stats
    from megarl.algorithms.policy_loss import (aggregate, centered_score_logprobs, kl_penalty, loss_knobs,
                                               loss_params, policy_loss)
    from megarl.algorithms.metrics import importance_metrics, staleness_metrics, to_floats
    from megarl.algorithms.config import AlgorithmConfig

    globals().update({key: value for key, value in locals().items() if key in __all__})
    return globals()[name]
