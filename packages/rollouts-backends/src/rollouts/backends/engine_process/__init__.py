"""The in-process sampler in a process of its own: the client, the worker and their wire frames."""
