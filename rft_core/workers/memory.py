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

import collections
import contextlib
import contextvars
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol

from schemas import PolicyRef

if TYPE_CHECKING:
    import torch

    from rft_core.stages.contracts import PPOUpdateInput
    from rft_core.stages.update import PolicyTrainer


class ModelSource(Protocol):
    """What a resident worker provides to the stage programs it runs."""

    def inference_model(self, ref: PolicyRef, *, dtype: str, role: str) -> "torch.nn.Module":
        """The model of ``ref`` (``role``: "policy" or "reference") in ``dtype`` on the worker's
        device, in eval mode, holding exactly the weights of ``ref``."""

    def trainer(self, inp: "PPOUpdateInput") -> "PolicyTrainer":
        """The policy trainer (model, AdamW state) holding exactly ``inp.policy``."""

    def trained(self, ref: PolicyRef) -> None:
        """The trainer now holds the policy committed as ``ref``."""


COUNTS: collections.Counter = collections.Counter()  # events of this process: model_loads, engine_builds, ...


def count(event: str, n: float = 1) -> None:
    """Add ``n`` to this process's counter ``event`` (read with ``counts``)."""
    COUNTS[event] += n


def count_bytes_read(path: "str | os.PathLike") -> None:
    """Count the bytes of a checkpoint read from storage (``bytes_read``): a file, or the weight
    files (``*.safetensors``, ``*.bin``) of a model folder. A hub id (no local folder) counts 0."""
    p = Path(path)
    if p.is_file():
        COUNTS["bytes_read"] += p.stat().st_size
    elif p.is_dir():
        COUNTS["bytes_read"] += sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin"))


def counts() -> dict[str, float]:
    """This process's event counters: ``model_loads`` (models read from storage), ``bytes_read``
    (their weight files and optimizer states), ``engine_builds`` (rollout engines built over a model read for them), and in a
    resident worker the sync and recovery counters (``rft_core.workers.resident``)."""
    return dict(COUNTS)


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
