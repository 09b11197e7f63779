"""The `rollouts` application built on the library: CLI, TOML run configs, the demo, its tiny models
and addition task, and plotting. It uses only the public functions of rollouts.loops and the lower
packages, as a user's own script would."""
