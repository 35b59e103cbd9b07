"""HiLoRe: what to store, compress or recompute for efficient GRPO training."""
