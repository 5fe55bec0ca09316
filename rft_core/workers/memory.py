"""Models from memory: how a stage program takes its model from a resident worker instead of
storage.

A stage program asks for its model through the functions here; outside a resident worker they
load it from storage exactly as before (``policy_model_path`` + ``load_causal_lm``), inside one
(``models_from(source)``, set by ``rft_core.workers.resident.ModelWorker`` around each program
it runs) they hand out the worker's resident copy, synced to the requested policy first. The
programs, their inputs, config hashes and shards are the same either way: only where the
weights come from differs.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from rft_core.workers.counters import COUNTS, count, counts  # noqa: F401 - re-exported
from schemas import PolicyRef

if TYPE_CHECKING:
    import torch

    from rft_core.stages.contracts import PPOUpdateInput


class ModelSource(Protocol):
    """What a resident worker provides to the stage programs it runs."""

    def inference_model(self, ref: PolicyRef, *, dtype: str, role: str) -> "torch.nn.Module":
        """The model of ``ref`` (``role``: "policy" or "reference") in ``dtype`` on the worker's
        device, in eval mode, holding exactly the weights of ``ref``."""

    def trainer(self, inp: "PPOUpdateInput") -> Any:
        """The policy trainer (``rft_core.stages.update.PolicyTrainer``: model, AdamW state)
        holding exactly ``inp.policy``."""

    def trained(self, ref: PolicyRef) -> None:
        """The trainer now holds the policy committed as ``ref``."""


_SOURCE: contextvars.ContextVar["ModelSource | None"] = contextvars.ContextVar("rft_model_source", default=None)


def current_source() -> "ModelSource | None":
    """The resident worker's model source of the running program, or None (load from storage)."""
    return _SOURCE.get()


@contextlib.contextmanager
def models_from(source: "ModelSource") -> Iterator[None]:
    """Stage programs run inside this context take their models from ``source``."""
    token = _SOURCE.set(source)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def inference_model(ref: PolicyRef, *, dtype: str, role: str = "policy") -> "torch.nn.Module":
    """The model of ``ref`` for an inference pass (a rollout, a log-prob pass): the resident
    worker's copy, or loaded from storage onto ``default_device()``.

    Raises:
        CheckpointPrunedError, ShardCorruptError: (from storage) see ``policy_model_path``.
        WeightlessPolicyError: (from storage) ``ref`` is an update that kept its weights in the
            resident workers' memory (``checkpoint.every`` > 1).
    """
    source = current_source()
    if source is not None:
        return source.inference_model(ref, dtype=dtype, role=role)
    from rft_core.models.loading import load_causal_lm
    from rft_core.models.logprobs import default_device
    from rft_core.stages.checkpoints import policy_model_path

    return load_causal_lm(policy_model_path(ref), dtype=dtype).to(default_device())


def config_folder(ref: PolicyRef) -> str:
    """A folder (or alias, hub id) holding ``ref``'s model config, tokenizer and processor
    files: its checkpoint, or for an update that kept its weights in memory the checkpoint its
    weights descend from (same architecture and tokenizer). Reads no weights.

    Raises:
        CheckpointPrunedError, ShardCorruptError: see ``policy_model_path``.
    """
    from rft_core.stages.checkpoints import policy_model_path
    from rft_core.workers.recovery import weights_base

    return policy_model_path(weights_base(ref))
