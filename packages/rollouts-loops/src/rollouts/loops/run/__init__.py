"""A run's surroundings: its directory, metrics loggers, ranks under torchrun, and the startup heap."""
