"""Run a stage program in this process: what ``run_stage`` does without a runner, and what a
resident worker does with its models from memory (``rft_core.workers.base.ResidentWorker.run``). Importing
this module registers every stage program (``PROGRAMS``)."""
from __future__ import annotations

import threading
from typing import Any

from rft_core.models.hub import configure_cuda_backends
# the stage modules register their programs in PROGRAMS when imported
from rft_core.stages import advantages, critic, dynamic, evaluate, logprobs, prompts, rewards, rollout, update  # noqa: F401
from rft_core.stages.contracts import PROGRAMS, StageInput
from rft_core.stages.sources import release_models

_IMPORT_LOCK = threading.Lock()
_IMPORTED = False


def import_transformers_once() -> None:
    """Resolve transformers' lazily imported classes once, under a lock, before stage programs
    run in threads side by side (the actor, reference and reward passes; a rollout overlapping
    the previous update with ``rollout.max_staleness``). transformers' lazy module is not
    thread-safe on first access: two threads importing ``AutoModelForCausalLM`` at once can fail
    with "cannot import name 'AutoModelForCausalLM' from 'transformers'" (seen in a rerun whose
    first two stages started together)."""
    global _IMPORTED
    if _IMPORTED:
        return
    with _IMPORT_LOCK:
        if not _IMPORTED:
            import transformers

            for name in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "AutoProcessor", "GenerationConfig",
                         "PreTrainedModel"):
                getattr(transformers, name)
            _IMPORTED = True


def run_in_process(inp: StageInput) -> Any:
    """Run the program of ``inp`` here and return what it returns. TF32 matmuls are enabled
    first (``configure_cuda_backends``); after a program that loads a model (``holds_model``)
    the CUDA cache is emptied (``release_models``), so a dropped model's memory goes back to the
    driver, except in a resident worker that keeps its cache. The other programs (prompts,
    rewards, advantages, ...) hold no model: a garbage collection and an emptied cache after them
    cost 0.3 to 0.7 s each on a GPU and freed nothing (issue 44, one H200)."""
    import_transformers_once()
    configure_cuda_backends()
    try:
        return PROGRAMS[inp.program](inp)
    finally:
        if type(inp).holds_model:
            release_models()
