"""Reward executor: verifiable math rewards in a process pool."""

from megarl.reward.math_reward import MathReward, score_one

__all__ = ["MathReward", "score_one"]
