"""Knobs of the RL algorithm: which loss and advantage estimator, and their parameters.

The lead composes :class:`AlgorithmConfig` into the top-level config; the trainer calls
``policy_loss(cfg.loss, ..., **loss_params(cfg))`` and
``compute_advantages(cfg.advantage, rewards, group_ids=..., **advantage_params(cfg))``. Those two
live beside the code whose parameters they pick (policy_loss.py, advantages.py): this module
imports no torch, so config validation stays fast.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megarl.utils.knobs import knob

# Defined here, not beside the torch code, so config validation never imports torch.
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
TIS_MODES = ("none", "token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3", "k1+", "k3+")  # megarl/algorithms/policy_loss.py kl_penalty

LOSS_NAMES = ("aipo", "ppo", "grpo", "decoupled_ppo", "a3po", "vaco", "sao")
ADVANTAGE_NAMES = ("grpo", "dr_grpo", "rloo", "gae", "vtrace")
CRITIC_ADVANTAGES = ("gae", "vtrace")  # estimators that need a critic (a value model, megarl/critic/)


@dataclasses.dataclass
class AlgorithmConfig:
    loss: str = knob("aipo", help="policy loss (see docs/algorithms.md); aipo is LlamaRL's truncated-IS "
                     "REINFORCE, the default for async training; default aipo", choices=LOSS_NAMES)
    rho: float = knob(4.0, help="aipo: cap on the importance weight pi/mu (dimensionless, > 0; LlamaRL uses 2..10); "
                      "default 4")
    eps_low: float = knob(0.2, help="ppo/grpo/decoupled_ppo/a3po/sao: lower clip, ratio floor 1 - eps_low "
                          "(dimensionless, in [0, 1)); default 0.2")
    eps_high: float = knob(0.2, help="ppo/grpo/decoupled_ppo/a3po/sao: upper clip, ratio ceiling 1 + eps_high "
                           "(dimensionless, >= 0; DAPO's clip-higher uses 0.28); default 0.2")
    dual_clip_c: Optional[float] = knob(None, help="ppo-family dual clip: caps the loss of negative-advantage "
                                        "tokens at -A*c (dimensionless, > 1, e.g. 3); default None = off")
    behav_weight_cap: Optional[float] = knob(None, help="decoupled_ppo/a3po: truncate the behaviour weight "
                                             "prox/mu at this value (dimensionless, > 0); default None = untruncated")
    tv_delta: float = knob(0.2, help="vaco: total-variation budget delta; filtering starts when the batch TV "
                           "estimate exceeds delta/2 (dimensionless, > 0); default 0.2")
    prox_check: bool = knob(False, help="a3po: also recompute the proximal logprobs (one no-grad forward pass "
                            "of the policy before the step's first update, as decoupled_ppo does) and log the "
                            "mean |approximated - recomputed| log prox over loss tokens as train/loss/prox_error "
                            "(nats; AReaL's metrics mode). Costs the forward pass A-3PO saves; training still uses "
                            "the approximation. default False")
    tis: str = knob("none", help="truncated importance sampling for train/inference mismatch: 'token' or "
                    "'sequence' level weight min(prox/mu, tis_cap); needs the trainer-recomputed prox "
                    "logprobs; default 'none'", choices=TIS_MODES)
    tis_cap: float = knob(2.0, help="TIS truncation cap (dimensionless, > 0); default 2")
    score_centering: bool = knob(False, help="center the score grad log pi(y) by its expectation under the "
                                 "sampler (exact with full-vocab logprobs, token approximation otherwise); "
                                 "default False")
    kl_coef: float = knob(0.0, help="weight of the KL penalty to the initial model added to the loss "
                          "(dimensionless, >= 0; needs reference logprobs); default 0 = off")
    kl_estimator: str = knob("k3", help="per-token KL estimator of the penalty, d = log pi - log ref: k2 (d^2/2; "
                             "its gradient is KL(pi || ref)'s), k3 (ref/pi - 1 - log(ref/pi); gradient of "
                             "KL(ref || pi), GRPO's), k1+ / k3+ (k1's d / k3's value, k2's gradient); k1 alone "
                             "is refused as a penalty (its gradient has mean 0); default k3", choices=KL_ESTIMATORS)
    entropy_coef: float = knob(0.0, help="weight of the entropy bonus subtracted from the loss (dimensionless, "
                               ">= 0; needs per-token entropy); default 0 = off")
    aggregation: str = knob("token-mean", help="how per-token losses reduce to a scalar: token-mean, "
                            "seq-mean-token-sum (Dr.GRPO-style) or seq-mean-token-mean; default token-mean",
                            choices=AGGREGATIONS)
    advantage: str = knob("grpo", help="advantage estimator: over the samples of one prompt grpo (mean/std), "
                          "dr_grpo (mean only) or rloo (leave-one-out mean); per token from a critic (a value "
                          "model, the critic: section) gae (GAE) or vtrace (V-trace for stale samples); "
                          "default grpo", choices=ADVANTAGE_NAMES)
    gae_gamma: float = knob(1.0, help="gae/vtrace: discount per reply token (dimensionless, in [0, 1]; observation "
                            "tokens of a multi-turn rollout are bridged, not discounted); default 1")
    gae_lambda: float = knob(1.0, help="gae/vtrace: GAE's lambda, the bias/variance trade of the multi-step "
                             "estimate (dimensionless, in [0, 1]; V-trace's c_i = lambda min(c_bar, pi/mu)); "
                             "default 1")
    vtrace_rho_bar: float = knob(1.0, help="vtrace: truncation of the importance weight pi/mu in each TD term "
                                 "(dimensionless, > 0; sets the value V-trace converges to, IMPALA uses 1); "
                                 "default 1")
    vtrace_c_bar: float = knob(1.0, help="vtrace: truncation of the trace weights c_i = lambda min(c_bar, pi/mu) "
                               "(dimensionless, > 0, at most vtrace_rho_bar in IMPALA; the variance of the "
                               "correction); default 1")
    normalize_std: bool = knob(True, help="grpo: divide the group-centered reward by the group std; "
                               "default True (False gives Dr.GRPO)")
    adv_eps: float = knob(1e-6, help="grpo: added to the group std before dividing (reward units); default 1e-6")

    teacher: Optional[str] = knob(None, help="on-policy distillation: the teacher's HF folder (config.json, weights, "
                                  "a tokenizer identical to the policy's); a forward-only Megatron executor gives "
                                  "its logprobs of the sampled tokens, and distill_coef * (log pi - log teacher) "
                                  "is subtracted from each token's advantage (metric distill/reverse_kl; "
                                  "megarl/algorithms/distill.py). default None = off")
    distill_coef: float = knob(0.0, help="on-policy distillation: weight of the per-token reverse KL "
                               "log pi - log teacher in the advantage (dimensionless, >= 0; > 0 needs "
                               "algorithm.teacher); default 0 = off")

    dynamic_sampling: bool = knob(False, help="DAPO's dynamic sampling: a prompt group whose rewards are all equal "
                                  "(advantage 0 for every sample: pure cost) is dropped from the step's batch and the "
                                  "batch is refilled from further prompts until controller.prompts_per_step groups "
                                  "vary or max_refill_rounds is spent (metrics batch/dropped_groups, "
                                  "batch/refill_rounds); default False")
    max_refill_rounds: int = knob(4, help="dynamic_sampling: refill rounds a step may take (count, >= 0); a step "
                                  "still short after them is padded back to controller.prompts_per_step groups with "
                                  "its dropped ones (advantage 0), so the batch keeps the shape trainer.minibatches "
                                  "and trainer.dp split (batch/padded_groups; the first such step is logged); "
                                  "default 4")

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> List[str]:
        """Every invalid value, each naming the key and quoting its help (empty when valid)."""
        found: List[str] = []
        helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(self)}
        for field in dataclasses.fields(self):
            choices = field.metadata.get("choices")
            value = getattr(self, field.name)
            if choices and value not in choices:
                found.append(f"algorithm.{field.name}={value!r} is not one of {', '.join(map(str, choices))}")
        checks = [("rho", self.rho > 0), ("eps_low", 0 <= self.eps_low < 1), ("eps_high", self.eps_high >= 0),
                  ("dual_clip_c", self.dual_clip_c is None or self.dual_clip_c > 1),
                  ("behav_weight_cap", self.behav_weight_cap is None or self.behav_weight_cap > 0),
                  ("tv_delta", self.tv_delta > 0), ("tis_cap", self.tis_cap > 0), ("kl_coef", self.kl_coef >= 0),
                  ("entropy_coef", self.entropy_coef >= 0), ("adv_eps", self.adv_eps >= 0),
                  ("max_refill_rounds", self.max_refill_rounds >= 0), ("gae_gamma", 0 <= self.gae_gamma <= 1),
                  ("gae_lambda", 0 <= self.gae_lambda <= 1), ("vtrace_rho_bar", self.vtrace_rho_bar > 0),
                  ("vtrace_c_bar", self.vtrace_c_bar > 0), ("distill_coef", self.distill_coef >= 0)]
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            found.append("algorithm.kl_estimator=k1 with kl_coef > 0: k1's gradient, grad log pi, has mean 0 on "
                         "tokens sampled from pi, so the penalty would not pull the policy toward the reference; "
                         "use k1+ (k1's value, the gradient of KL(pi || ref)), k2 or k3")
        if self.prox_check and self.loss != "a3po":
            found.append(f"algorithm.prox_check=true compares a3po's approximated proximal logprobs with recomputed "
                         f"ones; loss {self.loss!r} has no approximation (set algorithm.loss=a3po or prox_check=false)")
        if self.distill_coef > 0 and not self.teacher:
            found.append(f"algorithm.distill_coef={self.distill_coef} needs algorithm.teacher (the teacher's HF "
                         f"folder); set it or set distill_coef=0")
        if self.teacher and not self.distill_coef > 0:
            found.append(f"algorithm.teacher={self.teacher!r} is used only with algorithm.distill_coef > 0 "
                         f"(e.g. 1.0); set it or drop algorithm.teacher")
        found += [f"algorithm.{name}={getattr(self, name)!r} is out of range: {helps[name]}"
                  for name, ok in checks if not ok]
        return found


# Losses that correct prox/mu themselves (policy_loss rejects tis != 'none' for them); a3po also
# approximates prox from the token versions instead of taking it.
OWN_BEHAVIOUR_CORRECTION = ("decoupled_ppo", "a3po")


def needs_prox(cfg: AlgorithmConfig) -> bool:
    """Whether the step needs trainer-recomputed proximal logprobs (a no-grad forward pass of the
    current policy before the update): decoupled_ppo's proximal policy, or TIS's recomputation of
    the sampling policy. Not a3po, which approximates them from the token versions, unless
    ``prox_check`` asks for the recomputed ones to compare (never to train with)."""
    if cfg.loss == "a3po":
        return bool(cfg.prox_check)
    return cfg.loss == "decoupled_ppo" or cfg.tis != "none"


def needs_ref(cfg: AlgorithmConfig) -> bool:
    """Whether the step needs reference-policy logprobs (a frozen copy of the initial model and a
    no-grad forward pass of it): the KL(pi || ref) penalty is on."""
    return cfg.kl_coef > 0


def needs_critic(cfg: AlgorithmConfig) -> bool:
    """Whether the job runs a critic (a value model executor): the advantage is gae or vtrace."""
    return cfg.advantage in CRITIC_ADVANTAGES


def needs_teacher(cfg: AlgorithmConfig) -> bool:
    """Whether the step needs the teacher's logprobs of the sampled tokens (a teacher executor's
    no-grad forward pass): on-policy distillation is on (algorithm.teacher, distill_coef > 0)."""
    return bool(cfg.teacher) and cfg.distill_coef > 0
