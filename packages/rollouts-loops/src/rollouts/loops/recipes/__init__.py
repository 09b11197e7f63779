"""Runnable recipes built only on the library, and the tiny local models and task they train."""
