"""Agent programs trained through an OpenAI-compatible endpoint: `agent_rollout(run)` serves each
episode its own base URL in front of the run's engine, records every turn's tokens exactly as
sampled, and turns the episode into Samples (endpoint.py, episode.py, rollout.py)."""
