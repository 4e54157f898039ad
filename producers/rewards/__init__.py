"""Reward functions: the built-in math reward, user rewards loaded by import path, an environment's own scorer."""

from rlbus.producers.rewards.math import compute_score, extract_answer
from rlbus.producers.rewards.registry import RewardError, RewardFn, env_reward, load_reward

__all__ = ["RewardError", "RewardFn", "compute_score", "env_reward", "extract_answer", "load_reward"]
