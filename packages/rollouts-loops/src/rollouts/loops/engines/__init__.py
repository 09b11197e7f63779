"""Engines for the loops: request coalescing, construction from an EngineSpec, and the rollout process."""
