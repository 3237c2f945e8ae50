"""Rewards: final-answer extraction, a registry of reward functions, and the scoring pool.

See docs/rewards.md. Importing this package imports neither torch nor math-verify.
"""

from megarl.reward import code, rewards, tools  # noqa: F401  (registers the built-ins: arithmetic, gsm8k, math, dapo, code; calculator)
from megarl.reward.config import RewardConfig
from megarl.reward.pool import RewardError, RewardPool, ScoredSample, overlong_penalty
from megarl.reward.registry import get_reward, known_rewards, register_reward

__all__ = ["RewardConfig", "RewardError", "RewardPool", "ScoredSample", "get_reward", "known_rewards",
           "overlong_penalty", "register_reward"]
