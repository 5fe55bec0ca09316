"""On-policy distillation's resident worker (``TeacherWorker``): runs ``teacher_logprobs`` on the
frozen teacher (``teacher.path``), loaded once per run, as the reference worker holds the
reference (again only if another teacher or dtype is asked for)."""
from __future__ import annotations

from typing import ClassVar

from rft_core.workers.reference import ReferenceWorker


class TeacherWorker(ReferenceWorker):
    """The teacher's worker: the reference worker's frozen log-prob copy, for the teacher.

    ``version``: the teacher (``version_key``: ``path:<teacher.path>``) that ``model`` was loaded
    from; None before the first pass.

    Args:
        pool, rank, ranks, threads, keep_device_cache, freeze_heap: ``ResidentWorker``'s.
    """

    role: ClassVar[str] = "teacher"
    programs: ClassVar[tuple[str, ...]] = ("teacher_logprobs",)
