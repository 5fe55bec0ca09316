"""Outcome rewards for math-style answers: extraction, grading, format bonus.

Grading uses the dataset's own grader (reasoning-gym ``score_answer``), or ``math-verify``
(``timeout_seconds=None`` / ``parsing_timeout=None``: its default timeout uses signal.alarm,
which fails off the main thread where Prefect runs tasks).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_LINE = re.compile(r"answer\s*[:：]\s*(.+)", re.I)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> tuple[str | None, bool]:
    """Extract the final answer from a response.

    Order: the last ``<answer>...</answer>`` tag; else the text after the last ``Answer:``
    (first line of it); else the last number anywhere in the text.

    Returns:
        (answer or None, formatted) where ``formatted`` is True when a tag or an Answer: line
        was found.
    """
    tags = _TAG.findall(text)
    if tags:
        return tags[-1].strip(), True
    lines = _ANSWER_LINE.findall(text)
    if lines:
        ans = lines[-1].strip().strip("*").strip()
        ans = ans.rstrip(".").strip()
        return ans, True
    nums = _NUMBER.findall(text)
    if nums:
        return nums[-1].replace(",", ""), False
    return None, False


def _normalise_numeric(ans: str) -> str:
    """Reduce '= 12.', '$12', '12 apples' to the first number when the answer starts numeric-ish."""
    m = _NUMBER.search(ans)
    return m.group(0).replace(",", "") if m else ans


@lru_cache(maxsize=64)
def _rg_scorer(source: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(source)


def grade_dataset(answer: str | None, *, source: str, question: str, label: str, metadata_json: str) -> float:
    """Score with reasoning-gym's grader of ``source`` (0..1)."""
    if answer is None:
        return 0.0
    entry = {"question": question, "answer": label, "metadata": json.loads(metadata_json)}
    score = float(_rg_scorer(source)(answer, entry))
    if score < 1.0:  # "Answer: 12 apples" -> try the bare number too
        score = max(score, float(_rg_scorer(source)(_normalise_numeric(answer), entry)))
    return score


def grade_math_verify(answer: str | None, *, label: str) -> float:
    """1.0 when math-verify finds ``answer`` equivalent to ``label``, else 0.0."""
    if answer is None:
        return 0.0
    from math_verify import parse, verify

    gold = parse(label, parsing_timeout=None)
    pred = parse(answer, parsing_timeout=None)
    if not gold or not pred:
        return float(answer.strip() == label.strip())
    return float(verify(gold, pred, timeout_seconds=None))


@dataclass(frozen=True)
class RewardResult:
    """One sample's reward and why.

    Attributes:
        reward: float, correct_reward * score + format_reward * formatted.
        correct: score >= 1.
        extracted: the extracted answer (None when nothing was found).
        metrics: per-source scores, stored in the shard's ``reward_metrics``.
    """

    reward: float
    correct: bool
    extracted: str | None
    metrics: dict[str, float]


def score_response(
    response: str,
    *,
    source: str,
    question: str,
    label: str,
    metadata_json: str,
    grader: str = "dataset",
    correct_reward: float = 1.0,
    format_reward: float = 0.0,
) -> RewardResult:
    """Outcome reward of one response.

    Raises:
        ValueError: unknown ``grader``.
    """
    answer, formatted = extract_answer(response)
    if grader == "dataset":
        score = grade_dataset(answer, source=source, question=question, label=label, metadata_json=metadata_json)
    elif grader == "math_verify":
        score = grade_math_verify(answer, label=label)
    else:
        raise ValueError(f"unknown grader {grader!r}; valid: dataset, math_verify")
    reward = correct_reward * score + format_reward * float(formatted)
    return RewardResult(reward, score >= 1.0, answer, {"correctness": score, "format": float(formatted)})
