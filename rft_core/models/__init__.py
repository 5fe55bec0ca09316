"""Model loading and per-token log-prob computation."""
