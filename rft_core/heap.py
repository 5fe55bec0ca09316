"""Python's cyclic garbage collector kept off the stages' critical path: a warm process's heap is
frozen (``gc.freeze``), so the collections that run at moments set by allocation counts walk
what was made since, not everything imported.

A process of this framework tracks about 350,000 objects once torch, transformers, Ray and
pyarrow are imported (440,000 with SmolLM2-135M loaded), and each collection of the oldest
generation walks all of them: 0.25-0.46 s on this project's 2-core CPU, and 0.3-0.8 s measured
inside ``rft train`` (a resident rollout worker: 0.36 s in the middle of a rollout; the training
flow's process: 0.70-0.80 s, while an iteration subflow was being created), every few
iterations (issue 44: one iteration in five spent 0.6-1.0 s more outside its stage programs).
vLLM freezes its heap once warm for the same reason (``freeze_gc_heap``, vllm/utils/gc_utils.py,
called at the end of ``compile_or_warm_up_model``: a full collection, then ``gc.freeze()``);
SGLang has ``freeze_gc``.

``freeze_grown_heap`` is called after each iteration (the training and replay flows,
``tests.drive(freeze_heap=True)``) and after each program a resident worker runs in a process of
its own (a Ray actor): when the objects outside the permanent generation number
``FREEZE_MIN_OBJECTS`` or more (the first iteration's imports and models; a resumed run's first
iteration that ran; rarely later), it collects once and freezes what is left. Frozen objects are
still freed by reference counting: a policy trainer (model, AdamW state, float32 masters; full or
LoRA) dropped after the freeze is freed at once (``tests/rft_core/test_heap.py``), which is what
stage mode's kept models (``rft_core.stages.memo``) and a rollout worker's reloaded model rely
on. Garbage in reference cycles among frozen objects waits for ``collect_all`` (unfreeze,
collect, freeze again), which the places that must see a dropped model's memory free at once
call (``release_device_memory``, a resident trainer or critic rebuilt), or for ``thaw_heap``,
which ends a run (``rft_core.api.release_run``): a process that runs several flows keeps nothing
of an earlier one frozen.
"""
from __future__ import annotations

import gc

FREEZE_MIN_OBJECTS = 100_000


def freeze_grown_heap(min_objects: int = FREEZE_MIN_OBJECTS) -> int:
    """When at least ``min_objects`` objects tracked by the collector lie outside its permanent
    generation (``len(gc.get_objects())``, which leaves the frozen ones out: about 13 ms per
    100,000 objects on this CPU, next to nothing once the heap is frozen), collect garbage (so that
    none of it is frozen; garbage another thread makes in between may be) and freeze the rest.

    Returns:
        The number of objects moved into the permanent generation now (0: none).
    """
    if len(gc.get_objects()) < min_objects:
        return 0
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count() - before


def collect_all() -> None:
    """A full collection that also reaches the frozen objects (``gc.unfreeze``, ``gc.collect``),
    the rest frozen again if the heap was: what frees a dropped object in a reference cycle that
    was frozen while it was alive."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()


def thaw_heap() -> None:
    """Move the frozen objects back into the oldest generation (``gc.unfreeze``): the next
    collections reach them again. Called when a run ends."""
    gc.unfreeze()
