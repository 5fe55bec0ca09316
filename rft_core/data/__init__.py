"""Prompt datasets."""
