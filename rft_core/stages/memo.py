"""Models kept in memory between the stage programs of one process (stage mode, in-process
runner, ``RunnerConfig.keep_models``, set from ``orchestration.keep_models``).

A stage-mode program reads its model from the run root: the rollout and the actor pass the
policy, the reference pass the reference, the update the policy with its float32 masters and
AdamW state. On a GPU that was 5.4 s of a 15.7 s step (one H200, the 0.4B shape of
``make bench-gpu``, 2026-11-28; issue 44), for models this process had just written or read.
Inside ``keeping_models(True)`` the stage programs take them from here instead:

- **inference models** (``inference_model``), keyed by the caller's version key (a committed
  stage's URI and manifest checksum, or a model folder with its weight files' sizes and mtimes)
  and dtype; the programs never change an inference model's weights (eval mode, no gradients);
- **the policy trainer of the last committed update** (``keep_trainer`` / ``take_trainer``):
  model, float32 masters, AdamW state and tokenizer, the very tensors the update wrote to its
  checkpoint and optimizer stage. It is taken out while an update runs and put back only after
  that update committed, so a failed update never leaves a half-trained trainer here;
- **the next policy's inference model made from that trainer** (same dtype, same parameter
  names): a copy of a kept inference model of the same architecture with every tensor of the
  trainer's ``state_dict`` copied in, which is what loading the checkpoint the update just wrote
  gives (the checkpoint is ``save_pretrained`` of these tensors).

What a program computes is the same either way; ``tests/rft_core/stages/test_stage_memo.py``
compares runs with and without it bit for bit. Callers still check the committed files first
(``policy_model_path``: pruned or damaged checkpoints raise as before; a file this process wrote
is not hashed again). A new process starts empty and reads storage: resume is unchanged.
Bounded: one trainer and ``MAX_INFERENCE`` inference models (the reference, a teacher, the
policy; least recently used first out). With ``checkpoint.every`` > 1 the updates between
checkpoints write no weights: the kept trainer is then the only copy of their policy, and a
process that does not hold it has it rebuilt exactly when a program asks for it (``rebuild``,
the stage runner's ``rft_core.stages.recovery.keep_rebuilt``). The same role in resident mode is played by the workers
(``rft_core.workers``), which also skip the checkpoint writes; this memo changes no write.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

MAX_INFERENCE = 3  # the reference, a teacher and the current policy

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("rft_keep_models", default=False)


class _Memo:
    """The process's kept models (module docstring), under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inference: collections.OrderedDict[tuple[str, str], "torch.nn.Module"] = collections.OrderedDict()
        self.trainer: tuple[str, str, Any] | None = None  # (key, settings, rft_core.stages.update.PolicyTrainer)
        self.hits = collections.Counter()


_MEMO = _Memo()


_REBUILD: contextvars.ContextVar[Callable[[Any], None] | None] = contextvars.ContextVar("rft_rebuild", default=None)


@contextlib.contextmanager
def keeping_models(on: bool, rebuild: Callable[[Any], None] | None = None) -> Iterator[None]:
    """Stage programs run inside this context keep and reuse models in memory (``on``) or read
    every model from storage (``on`` False, the stage process's behaviour). ``rebuild(ref)``
    makes the memo hold the trainer of a policy whose weights were kept in memory only
    (``checkpoint.every`` > 1) when this process lost it (``rebuild``; the stage runner hands in
    ``rft_core.stages.recovery.keep_rebuilt``, which sits above the programs it re-runs)."""
    token, fn = _ACTIVE.set(on), _REBUILD.set(rebuild if on else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _REBUILD.reset(fn)


def keeps_models() -> bool:
    """Whether the running program keeps its models (``keeping_models``)."""
    return _ACTIVE.get()


def rebuild(ref: Any) -> None:
    """Have the trainer of ``ref`` (a committed update whose weights were kept in memory only)
    kept here, rebuilt by the ``rebuild`` that ``keeping_models`` was given; nothing without one
    (the caller's read from storage then raises ``WeightlessPolicyError``)."""
    fn = _REBUILD.get()
    if fn is not None:
        fn(ref)


def hits() -> dict[str, int]:
    """How often each kind of kept model was served: ``inference``, ``inference_from_trainer``,
    ``trainer`` (for tests and benchmarks)."""
    return dict(_MEMO.hits)


def clear() -> None:
    """Drop every kept model (the next program reads storage): what a run does when it ends
    (``rft_core.api.release_run``), so a process that runs several flows holds no model of an earlier one."""
    with _MEMO.lock:
        _MEMO.inference.clear()
        _MEMO.trainer = None
        _MEMO.hits.clear()


def inference_model(key: str | None, dtype: str, load: Callable[[], "torch.nn.Module"], *,
                    check: Callable[[], None] | None = None,
                    template: Callable[[], "torch.nn.Module"] | None = None) -> "torch.nn.Module":
    """The inference model of version ``key`` in ``dtype``: ``load()`` outside ``keeping_models``
    or for ``key`` None; else the kept one, or one made from the kept trainer when it holds
    ``key`` (module docstring), or ``load()``, kept for the next call.

    Args:
        key: the version key (``rft_core.stages.sources.version_key`` and the folder's fingerprint).
        dtype: "float32" or "bfloat16".
        load: reads the model from storage (on ``default_device()``, eval mode), with its checks.
        check: the checks ``load`` makes of the stored files, without reading the weights; run
            before a kept or made model is served (its errors raise as ``load``'s would).
        template: for a version whose weights are in memory only (``checkpoint.every`` > 1 in
            stage mode): loads a model of its architecture (the checkpoint it descends from) into
            which the kept trainer's tensors are copied, when no kept model can serve as one (a
            trainer rebuilt after a restart: ``rebuild``).
    """
    if not keeps_models() or key is None:
        return load()
    slot = (key, dtype)
    with _MEMO.lock:
        kept = slot in _MEMO.inference or (_MEMO.trainer is not None and _MEMO.trainer[0] == key)
    if kept and check is not None:
        check()
    with _MEMO.lock:
        model = _MEMO.inference.get(slot)
        if model is not None:
            _MEMO.inference.move_to_end(slot)
            _MEMO.hits["inference"] += 1
            return model
        made = _from_trainer(key)
    if made is None and kept and template is not None:
        base = template()
        with _MEMO.lock:
            made = _from_trainer(key, base)
    if made is not None:
        _MEMO.hits["inference_from_trainer"] += 1
        model = made
    else:
        model = load()
    with _MEMO.lock:
        _MEMO.inference[slot] = model
        _MEMO.inference.move_to_end(slot)
        while len(_MEMO.inference) > MAX_INFERENCE:
            _MEMO.inference.popitem(last=False)
    return model


def _from_trainer(key: str, base: "torch.nn.Module | None" = None) -> "torch.nn.Module | None":
    """(Under the lock.) An inference model holding the kept trainer's weights when it holds
    ``key``: a copy of a kept inference model (or ``base`` itself, a model loaded for this) of the
    same model config (its non-persistent buffers, such as rotary frequencies, come from it) whose
    ``state_dict`` has the same names, shapes, dtypes and devices, with the trainer's tensors
    copied in; None when there is no such pair."""
    if _MEMO.trainer is None or _MEMO.trainer[0] != key:
        return None
    trained_model = _MEMO.trainer[2].strategy.model
    trained = trained_model.state_dict()
    config = _config_of(trained_model)
    for template in [base] if base is not None else reversed(_MEMO.inference.values()):
        own = template.state_dict()
        if _config_of(template) == config and own.keys() == trained.keys() and all(
                (t.shape, t.dtype, t.device) == (own[n].shape, own[n].dtype, own[n].device) for n, t in trained.items()):
            import torch  # lazy: this module is imported where torch may not be loaded yet

            model = template if base is not None else copy.deepcopy(template)
            with torch.no_grad():
                for name, tensor in model.state_dict().items():
                    tensor.copy_(trained[name])
            model.generation_config = copy.deepcopy(trained_model.generation_config)
            return model.eval()
    return None


def _config_of(model) -> dict | None:
    """A model's config as a dict, without where it was loaded from (None: no HF config)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}


def serves(key: str, dtype: str | None) -> bool:
    """Whether the memo can serve version ``key`` without storage: its kept trainer holds it, or
    (``dtype`` given) a kept inference model of it in ``dtype``."""
    with _MEMO.lock:
        return (_MEMO.trainer is not None and _MEMO.trainer[0] == key) or (
            dtype is not None and (key, dtype) in _MEMO.inference)


def take_trainer(key: str, settings: str) -> Any | None:
    """The kept trainer when it holds ``key`` and was built with ``settings`` (taken out: an
    update that fails leaves nothing behind), else None; None outside ``keeping_models``.

    Args:
        key: the version key of the policy the update starts from.
        settings: what else the trainer was built from (``rft_core.stages.update.trainer_settings``).
    """
    if not keeps_models():
        return None
    with _MEMO.lock:
        held, _MEMO.trainer = _MEMO.trainer, None
    if held is None or held[:2] != (key, settings):
        return None
    _MEMO.hits["trainer"] += 1
    return held[2]


def keep_trainer(key: str, settings: str, trainer: Any) -> None:
    """Keep ``trainer`` (a ``rft_core.stages.update.PolicyTrainer`` holding the committed version
    ``key``, built with ``settings``) for the next update and the next policy's inference model;
    nothing outside ``keeping_models``."""
    if keeps_models():
        with _MEMO.lock:
            _MEMO.trainer = (key, settings, trainer)
