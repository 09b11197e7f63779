"""Checkpoints and weight files: crash-safe save and resume, exports, LoRA adapters and model directories."""
