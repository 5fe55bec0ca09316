"""Prefect flows: the order of stages, loops and UI artifacts. No tensors here."""
import logging

from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler


class _InPrefectRun(logging.Filter):
    """Pass records logged inside a flow or task run (elsewhere there is no run to attach them
    to, and Prefect's handler would warn about each line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return FlowRunContext.get() is not None or TaskRunContext.get() is not None


# Stage programs log through the standard `rft_core` logger. Send it to the run logs in the UI
# (Prefect's API handler, as PREFECT_LOGGING_EXTRA_LOGGERS would, but only inside runs and
# whatever the import order), and let INFO through: its effective level would otherwise be the
# root's WARNING, and "reusing committed shard" and progress lines would never be seen.
_rft_logger = logging.getLogger("rft_core")
if not any(isinstance(h, APILogHandler) for h in _rft_logger.handlers):
    _api_handler = APILogHandler()
    _api_handler.addFilter(_InPrefectRun())
    _rft_logger.addHandler(_api_handler)
if _rft_logger.level == logging.NOTSET:
    _rft_logger.setLevel(logging.INFO)
