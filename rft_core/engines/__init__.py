"""Rollout engines: batched generation behind one interface."""
