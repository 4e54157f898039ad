"""Reward functions: the built-in math reward and user rewards loaded by import path."""

from rlbus.producers.rewards.math import compute_score, extract_answer
from rlbus.producers.rewards.registry import RewardError, RewardFn, load_reward

__all__ = ["RewardError", "RewardFn", "compute_score", "extract_answer", "load_reward"]
