"""On-policy distillation's teacher: the check that it reads the policy's token ids.

The ``teacher_logprobs`` stage (its program is the log-prob pass of ``rft_core.stages.logprobs``)
scores the rollout's token ids with the teacher, so the teacher must map every token to the same
id as the policy's tokenizer does, or its log-probs are of other tokens. verl requires the same
(docs/algo/opd.md: "The teacher must share the student's tokenizer and vocabulary") without
checking it; here a teacher with another token -> id map is refused before the first stage
(``tasks.check_teacher``) and again by the stage before it computes anything.
"""
from __future__ import annotations

from rft_core.models.loading import leased_tokenizer


class TeacherTokenizerError(ValueError):
    """The teacher's tokenizer maps tokens to ids otherwise than the policy's; the message names
    both paths and the first difference."""


def _first_difference(student: dict[str, int], teacher: dict[str, int]) -> str:
    """The first token (by the student's id) whose id differs or that one side lacks, in words."""
    for token, sid in sorted(student.items(), key=lambda kv: kv[1]):
        tid = teacher.get(token)
        if tid != sid:
            return (f"token {token!r} is id {sid} in the policy's and " +
                    (f"id {tid} in the teacher's" if tid is not None else "absent from the teacher's"))
    extra = sorted(set(teacher) - set(student), key=lambda t: teacher[t])
    return f"token {extra[0]!r} (id {teacher[extra[0]]}) is in the teacher's only"


def check_teacher_tokenizer(policy_path: str, teacher_path: str) -> str:
    """Refuse a teacher whose tokenizer is not the policy's: their token -> id maps
    (``get_vocab()``, added tokens included) must be equal. The chat template and the special
    tokens' roles may differ (the stage scores token ids, never text).

    Args:
        policy_path: ``policy.path`` (the tokenizer the prompts and responses are in).
        teacher_path: ``teacher.path``.
    Returns:
        a one-line summary: both paths and the vocabulary size.
    Raises:
        TeacherTokenizerError: the maps differ; the message names both paths, both sizes and
            the first token that differs.
        ModelLoadError: a tokenizer cannot be loaded (the path is in the message).
    """
    with leased_tokenizer(policy_path) as tok:
        student = tok.get_vocab()
    with leased_tokenizer(teacher_path) as tok:
        teacher = tok.get_vocab()
    if student != teacher:
        raise TeacherTokenizerError(
            f"teacher.path {teacher_path!r} has another tokenizer than policy.path {policy_path!r} "
            f"({len(teacher)} vs {len(student)} tokens; {_first_difference(student, teacher)}): on-policy distillation "
            "scores the policy's token ids with the teacher, so both must map every token to the same id; choose a "
            "teacher of the policy's model family (or a checkpoint of the policy)")
    return f"teacher {teacher_path!r}: the tokenizer of policy {policy_path!r} ({len(student)} tokens)"
