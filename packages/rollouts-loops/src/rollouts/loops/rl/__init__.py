"""The RL loop: its driver, one step, the policy update, generation on rank 0, and the run's saved state."""
