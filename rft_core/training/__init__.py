"""Policy update: optimizer, micro-batched PPO step, checkpoints."""
