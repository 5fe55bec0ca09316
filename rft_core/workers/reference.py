"""The reference model's resident worker (``ReferenceWorker``): runs ``ref_logprobs`` on the
frozen reference model, loaded from storage once per run (again only if another reference or
dtype is asked for)."""
from __future__ import annotations

from typing import ClassVar

import torch

from rft_core.stages.sources import load_from_storage, version_key
from rft_core.workers.base import ResidentWorker
from schemas import PolicyRef


class ReferenceWorker(ResidentWorker):
    """The reference model's worker (see the module docstring).

    ``version``: the reference checkpoint (``version_key``: its path, or a committed update's URI
    and checksum) that ``model`` was loaded from; None before the first pass.

    Args:
        pool, rank, ranks, threads, keep_device_cache, freeze_heap: ``ResidentWorker``'s.
    """

    role: ClassVar[str] = "reference"
    programs: ClassVar[tuple[str, ...]] = ("ref_logprobs",)

    def __init__(self, pool: str, *, rank: int = 0, ranks: int = 1, threads: int | None = None,
                 keep_device_cache: bool = True, freeze_heap: bool = False) -> None:
        super().__init__(pool, rank=rank, ranks=ranks, threads=threads, keep_device_cache=keep_device_cache,
                         freeze_heap=freeze_heap)
        self.model: torch.nn.Module | None = None
        self.model_dtype: str | None = None

    def inference_model(self, ref: PolicyRef, *, dtype: str, role: str) -> torch.nn.Module:
        """``ModelSource.inference_model``: the model of ``ref`` in ``dtype``, loaded once.

        Raises:
            ValueError: ``role`` is not this worker's (``self.role``: "reference", or "teacher"
                for ``TeacherWorker``).
        """
        if role != self.role:
            raise ValueError(f"the {self.role} worker holds the {self.role} model, not the {role}")
        key = version_key(ref)
        if self.model is None or self.version != key or self.model_dtype != dtype:
            self.model, self.version, self.model_dtype = load_from_storage(ref, dtype=dtype), key, dtype
        return self.model
