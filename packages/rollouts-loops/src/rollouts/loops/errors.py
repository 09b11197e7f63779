"""Errors of the loops that the command line reports without a traceback (no heavy imports here)."""


class DamagedCheckpointError(ValueError):
    """The checkpoint a run would resume from failed its check; nothing was loaded or deleted."""


class ConfigError(ValueError):
    """A run config is invalid; the message names the file and the key."""
