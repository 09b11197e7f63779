"""Training as functions: components, forward_backward, optim_step, FSDP2, LoRA and the PPO critic."""
