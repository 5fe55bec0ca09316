"""Prefect flows: the order of stages, loops and UI artifacts. No tensors here."""
import os

# stage programs log through the standard `rft_core` logger; show it in the Prefect run logs
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rft_core")
