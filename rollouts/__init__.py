"""Episodes (the multi-turn runner and the Rollout record), advantages, and packing into per-rank micro-batches."""
