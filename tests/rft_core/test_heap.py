"""``rft_core.heap``: a grown heap is frozen (garbage collected first, never frozen), a small one
is left alone, a reference cycle frozen while alive is freed by ``collect_all`` (which plain
collections no longer reach) and the heap is frozen again after it; a policy trainer (full or
LoRA) frozen while alive is freed by its reference count alone once dropped (no cycle holds it);
resident workers freeze only in a process of their own (a Ray actor), after their first program."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from rft_core.config import UpdateConfig, WorkersConfig
from rft_core.config.scale import LoraConfig
from rft_core.heap import collect_all, freeze_grown_heap, thaw_heap
from rft_core.stages.update import build_trainer
from rft_core.workers import base
from rft_core.workers.policy import PolicyWorker
from rft_core.workers.reference import ReferenceWorker
from rft_core.workers.rollout import RolloutWorker


class Node:
    """A weak-referenceable object to build reference cycles from."""

    other: "Node | None" = None


def _cycle() -> weakref.ref:
    """A two-node reference cycle nothing else refers to once this returns; a weak reference to it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def thawed():
    """The heap thawed and the collector on again after the test, whatever it did."""
    enabled = gc.isenabled()
    thaw_heap()
    yield
    thaw_heap()
    if enabled:
        gc.enable()


def test_a_heap_under_the_threshold_is_left_alone(thawed):
    assert gc.get_freeze_count() == 0
    assert freeze_grown_heap(min_objects=len(gc.get_objects()) + 10**6) == 0
    assert gc.get_freeze_count() == 0


def test_a_grown_heap_is_collected_then_frozen(thawed):
    gc.disable()  # so that only freeze_grown_heap's own collection can free the cycle below
    garbage = _cycle()
    assert garbage() is not None  # unreachable, not collected yet
    frozen = freeze_grown_heap(min_objects=1)
    assert garbage() is None  # collected before the freeze, not frozen with the rest
    # (other threads of a test process may free a few frozen objects by reference count meanwhile)
    assert frozen > 1000 and gc.get_freeze_count() > frozen * 0.99
    assert len(gc.get_objects()) < frozen // 10  # what is left for later collections to walk
    assert freeze_grown_heap() == 0  # nothing grew since


def test_collect_all_frees_a_cycle_frozen_while_alive_and_freezes_again(thawed):
    alive = Node()
    alive.other = Node()
    alive.other.other = alive
    ref = weakref.ref(alive)
    assert freeze_grown_heap(min_objects=1) > 0
    del alive  # now garbage, in the permanent generation
    gc.collect()
    assert ref() is not None  # out of a plain collection's reach: the reason collect_all exists
    collect_all()
    assert ref() is None
    assert gc.get_freeze_count() > 1000  # the rest frozen again


def test_collect_all_on_a_thawed_heap_is_a_plain_collection(thawed):
    gc.disable()
    garbage = _cycle()
    collect_all()
    assert garbage() is None and gc.get_freeze_count() == 0


def test_resident_workers_freeze_only_as_actors():
    workers = WorkersConfig(pool="test")
    for cls in (PolicyWorker, RolloutWorker, ReferenceWorker):
        assert cls.kwargs_from(workers)["freeze_heap"] is True  # the pool's Ray actors (rft_core.workers.pool)
        assert cls("test", **{**cls.kwargs_from(workers), "threads": None}).freeze_heap is True
        assert cls("test").freeze_heap is False  # one made in the caller's process (tests, benchmarks)


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=4)], ids=["full", "lora"])
def test_a_trainer_frozen_while_alive_is_freed_by_its_reference_count(thawed, tiny_model, lora):
    """What lets the heap stay frozen while stage mode's memo or a resident worker drops its
    trainer: nothing but reference counts holds a trainer (model, AdamW state, float32 masters),
    so dropping it frees it with the collector off."""
    trainer = build_trainer(tiny_model, UpdateConfig(lora=lora), dtype="float32", opt_ref=None)
    model = trainer.strategy.model
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    trainer.strategy.optimizer.step()  # AdamW moments exist
    del model
    assert trainer.strategy.optimizer.state and freeze_grown_heap(min_objects=1) > 0
    gc.disable()
    refs = [weakref.ref(o) for o in (trainer, trainer.strategy, trainer.strategy.model, trainer.strategy.optimizer,
                                     next(trainer.strategy.model.parameters()))]
    assert all(r() is not None for r in refs)
    del trainer
    assert [r() is None for r in refs] == [True] * len(refs)


def test_a_worker_freezes_after_its_program_only_with_freeze_heap(thawed, monkeypatch):
    """The wiring of ``ResidentWorker.run``: the program first (here a stand-in for
    ``run_in_process`` that records the freeze count it ran under), then, with ``freeze_heap``,
    the heap frozen; without it, left alone."""
    seen: list[int] = []
    monkeypatch.setattr(base, "run_in_process", lambda inp: seen.append(gc.get_freeze_count()) or "committed")

    class Echo(base.ResidentWorker):
        role, programs = "echo", ("prompts",)

    inp = SimpleNamespace(program="prompts")
    assert Echo("test").run(inp) == "committed" and gc.get_freeze_count() == 0
    assert Echo("test", freeze_heap=True).run(inp) == "committed"
    assert seen == [0, 0] and gc.get_freeze_count() > 100_000  # this process: torch, transformers, pytest
