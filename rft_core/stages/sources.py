"""Models from memory: how a stage program takes its model from a resident worker instead of
storage.

A stage program asks for its model through the functions here; outside a resident worker they
load it from storage exactly as before (``policy_model_path`` + ``load_causal_lm``), inside one
(``models_from(source)``, set by the resident worker, ``rft_core.workers.base.ResidentWorker.run``,
around each program it runs) they hand out the worker's resident copy, synced to the requested policy first. The
programs, their inputs, config hashes and shards are the same either way: only where the
weights come from differs.
"""
from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from rft_core.models.critic import load_critic
from rft_core.models.loading import load_causal_lm, resolve_model_path
from rft_core.models.logprobs import default_device, release_device_memory
from rft_core.stages.checkpoints import CRITIC_SUBDIR, check_policy_weights, policy_model_path
from rft_core.stages.contracts import PPOUpdateInput
import rft_core.stages.memo as memo
from rft_core.stages.lineage import kept_in_memory, weights_base
from rft_core.stages.retention import WEIGHT_SUFFIXES
from schemas import PolicyRef

if TYPE_CHECKING:
    import torch


class ModelSource(Protocol):
    """What a resident worker provides to the stage programs it runs (``rft_core.workers``
    implements it, each role's worker the part its programs call: the policy trainer
    ``trainer`` and ``trained``, the rollout engine ``inference_model`` and ``engine_policy``,
    the reference and the teacher ``inference_model``, the critic the ``critic_*`` methods; the stage programs
    only see this protocol)."""

    def inference_model(self, ref: PolicyRef, *, dtype: str, role: str) -> "torch.nn.Module":
        """The model of ``ref`` (``role``: "policy", "reference" or "teacher") in ``dtype`` on the worker's
        device, in eval mode, holding exactly the weights of ``ref``."""

    def trainer(self, inp: PPOUpdateInput) -> Any:
        """The policy trainer (``rft_core.stages.update.PolicyTrainer``: model, AdamW state)
        holding exactly ``inp.policy``."""

    def trained(self, ref: PolicyRef) -> None:
        """The trainer now holds the policy committed as ``ref``."""

    def critic_model(self, ref: PolicyRef, *, dtype: str) -> "torch.nn.Module | None":
        """The critic of ``ref`` in ``dtype``, in eval mode (the values pass); None on a rank
        above 0 of a sharded critic's gang (rank 0 runs the pass alone, from storage)."""

    def critic_strategy(self, ref: PolicyRef, build: Callable[[], Any], *, lr: float, max_grad_norm: float) -> Any:
        """The critic's strategy holding ``ref`` (``build()`` when not held)."""

    def critic_trained(self, ref: PolicyRef) -> None:
        """The critic's strategy now holds the critic committed as ``ref``."""

    keeps_device_cache: bool
    """Whether the worker keeps the CUDA caching allocator's blocks after a program: a resident
    worker runs the same passes every iteration and reuses them (``release_models``)."""

    engine_lora: bool
    """Whether the rollout's GPU engine serves a LoRA policy's adapters (the run's ``update.lora``):
    built with LoRA on the base, it gets each version's adapters from ``engine_policy``."""

    def engine_policy(self, engine: Any, ref: PolicyRef) -> None:
        """Make the rollout's GPU engine (``VLLMEngine``, ``SGLangEngine``, built once per run by
        ``rft_core.stages.rollout.make_engine``) hold exactly ``ref``: an in-memory weight sync
        (``rft_core.weightsync``) or, when ``ref`` is on storage and not held, a reload.

        Raises:
            WeightSyncError: the sync failed or its checksums differ (the engine is then invalid).
        """


def version_key(ref: PolicyRef) -> str:
    """What identifies a policy version: a model path, or a committed update's URI and manifest checksum."""
    return f"path:{ref}" if isinstance(ref, str) else f"{ref.uri}@{ref.manifest_sha256}"


_SOURCE: contextvars.ContextVar["ModelSource | None"] = contextvars.ContextVar("rft_model_source", default=None)


def current_source() -> "ModelSource | None":
    """The resident worker's model source of the running program, or None (load from storage)."""
    return _SOURCE.get()


@contextlib.contextmanager
def models_from(source: "ModelSource | None") -> Iterator[None]:
    """Stage programs run inside this context take their models from ``source`` (None: from storage)."""
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
            memory (``checkpoint.every`` > 1) of resident workers, or of stage mode keeping its
            models where this process does not hold it.
    """
    source = current_source()
    if source is not None:
        return source.inference_model(ref, dtype=dtype, role=role)
    return load_from_storage(ref, dtype=dtype)


def release_models() -> bool:
    """After a stage program dropped its models: give the CUDA cache back to the driver
    (``release_device_memory``), so the next stage's process, a colocated engine (vLLM's
    free-memory check, SGLang) or another worker on the GPU finds the memory free; except inside
    a resident worker that keeps its cache (``ModelSource.keeps_device_cache``): it holds its
    models and runs the same passes every iteration, and re-growing the cache through
    ``cudaMalloc`` after every stage cost seconds per iteration and made the rollout's time swing
    on a GPU (issue 44; an H200, 2026-11-28: the same rollout in 2.8 to 8.6 s).

    Returns:
        True if the cache was emptied.
    """
    source = current_source()
    if source is not None and getattr(source, "keeps_device_cache", False):
        return False
    if memo.keeps_models():  # stage mode keeping its models in memory: their blocks are used again
        return False
    return release_device_memory()


def load_from_storage(ref: PolicyRef, *, dtype: str, merge_adapter: bool | None = None) -> "torch.nn.Module":
    """The model of ``ref`` read from storage in ``dtype`` onto ``default_device()``, in eval
    mode: what a stage-mode inference pass loads, and a resident worker's frozen copy (the
    reference, the teacher, the rollout worker's policy) before it stays in memory. Inside
    ``rft_core.stages.memo.keeping_models`` (stage mode's in-process runs) a model this process
    read or trained before is taken from memory, after the same checks of the committed files
    (``check_policy_weights``, which reads no weights).

    A policy whose weights this process keeps in memory only (``kept_in_memory``: stage mode
    with ``checkpoint.every`` > 1, between checkpoints) is made from the kept trainer, on a model
    of its architecture: a kept one, or the checkpoint it descends from (``weights_base``) read
    for it; a process that does not hold its trainer (a rerun after a crash) has it rebuilt first
    (``memo.rebuild``: the committed updates re-applied to the last checkpoint, each checked against
    its recorded digest, ``rft_core.stages.recovery``); nothing on storage is checked for it.

    ``merge_adapter``: ``load_causal_lm``'s (None: a LoRA policy merged in float32 only, as the
    trainer computes); True or False: merged or not whatever the dtype, read from storage, never
    the memo's copy (the resident rollout worker, whose syncs land the trainer's merged weights
    or its adapters).

    Raises:
        CheckpointPrunedError, ShardCorruptError, WeightlessPolicyError: see ``inference_model``.
    """
    def read(model: PolicyRef) -> "torch.nn.Module":
        return load_causal_lm(policy_model_path(model), dtype=dtype, merge_adapter=merge_adapter).to(
            default_device()).eval()

    if merge_adapter is not None:  # merged or not whatever the dtype: never the memo's copy (keeps_adapters)
        return read(ref)

    if kept_in_memory(ref):
        key = _memo_key(ref)
        if not memo.serves(key, dtype):  # a process that lost it (a rerun after a crash): rebuilt exactly, then kept
            memo.rebuild(ref)  # (nothing outside keeping_models: the read below then raises WeightlessPolicyError)
        return memo.inference_model(key, dtype, lambda: read(ref), template=lambda: read(weights_base(ref)))
    check = None if isinstance(ref, str) else (lambda: check_policy_weights(ref))  # a kept model skips the read only
    return memo.inference_model(_memo_key(ref), dtype, lambda: read(ref), check=check)


def _memo_key(ref: PolicyRef) -> str | None:
    """What identifies the weights of ``ref`` for ``rft_core.stages.memo``: a committed stage's
    ``version_key``; a model folder's path with its weight files' names, sizes and mtimes (None,
    not kept, for a folder that is not local or holds no weight file)."""
    if not isinstance(ref, str):
        return version_key(ref)
    folder = Path(resolve_model_path(ref))
    if not folder.is_dir():
        return None
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                   if f.name.endswith(WEIGHT_SUFFIXES))
    return f"path:{folder.resolve()}:{files}" if files else None


def critic_model(ref: PolicyRef, *, dtype: str) -> "torch.nn.Module | None":
    """The critic of ``ref`` (an initial model path or a committed ``critic_update``) for the
    values pass: the resident critic worker's trained model when it holds ``ref``, else loaded
    from storage onto ``default_device()``; None on a rank above 0 of the resident sharded critic's
    gang (``ModelSource.critic_model``: rank 0 runs the pass alone).

    Raises:
        CheckpointPrunedError, ShardCorruptError: (from storage) see ``policy_model_path``.
    """
    source = current_source()
    if source is not None:
        return source.critic_model(ref, dtype=dtype)
    return load_critic(policy_model_path(ref, CRITIC_SUBDIR), dtype=dtype).to(default_device())


def critic_strategy(ref: PolicyRef, build: "Callable[[], Any]", *, lr: float, max_grad_norm: float) -> Any:
    """The critic's training strategy (model and AdamW state) holding ``ref``: the resident
    critic worker's, continued with this update's ``lr`` and ``max_grad_norm``, or ``build()``
    (from storage) outside a worker or when the worker does not hold ``ref``."""
    source = current_source()
    if source is None:
        return build()
    return source.critic_strategy(ref, build, lr=lr, max_grad_norm=max_grad_norm)


def critic_trained(ref: PolicyRef) -> None:
    """Tell the resident critic worker (if any) that its strategy now holds the committed ``ref``."""
    source = current_source()
    if source is not None:
        source.critic_trained(ref)


def config_folder(ref: PolicyRef) -> str:
    """A folder (or alias, hub id) holding ``ref``'s model config, tokenizer and processor
    files: its checkpoint, or for an update that kept its weights in memory the checkpoint its
    weights descend from (same architecture and tokenizer). Reads no weights.

    Raises:
        CheckpointPrunedError, ShardCorruptError: see ``policy_model_path``.
    """
    return policy_model_path(weights_base(ref))
