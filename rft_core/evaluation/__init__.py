"""Evaluation metrics over sampled answers (``metrics``): avg@k, pass@k, maj@k with standard errors."""
