"""Rollouts as users plug them in: rollout functions, multi-turn tools, environments, rewards and reward models."""
