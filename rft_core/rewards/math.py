"""Outcome rewards for math-style answers: extraction, grading, format bonus.

Grading uses the dataset's own grader (reasoning-gym ``score_answer``) on the answer that
``extract_answer`` cuts out, or ``math-verify``, which extracts the answer itself from the whole
response (``\\boxed{}``, LaTeX, ``Answer:``/``final answer is`` lines, plain numbers: its ``parse``
with its default extraction configs), or from the last ``<answer>`` tag when there is one.
``math-verify`` runs with ``timeout_seconds=None`` / ``parsing_timeout=None``: its default
timeout uses signal.alarm, which fails off the main thread where Prefect runs tasks; the
``math_answer`` source bounds it with a killable worker process instead.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from rft_core.rewards.base import RewardError, SourceScore

_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_LINE = re.compile(r"answer\s*[:：]\s*(.+)", re.I)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> tuple[str | None, bool]:
    """Extract the final answer from a response: for the format bonus, the ``dataset`` grader and
    ``exact_match`` (the ``math_verify`` grader extracts on its own: ``grade_math_verify``).

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


def _mv_parse(text: str, *, bare: bool) -> list:
    """math-verify's ``parse`` with its default extraction configs (LaTeX, then plain expressions).

    ``bare``: ``text`` is an answer on its own (a label, the content of an ``<answer>`` tag),
    not a response: without ``$`` or ``\\boxed`` it is read as one LaTeX expression first, since
    math-verify reads undelimited LaTeX only in part (``2\\sqrt{2}`` as 2, ``\\dfrac{3}{4}`` not
    at all); the plain parse when that finds nothing.
    """
    from math_verify import parse

    if bare and "$" not in text and "\\boxed" not in text:
        got = parse(f"${text}$", parsing_timeout=None)
        if got:
            return got
    return parse(text, parsing_timeout=None)


def _mv_text(parsed: list) -> str | None:
    """The answer text math-verify extracted (its string match), else the parsed value's text."""
    strings = [x for x in parsed if isinstance(x, str)]
    return strings[-1] if strings else (str(parsed[0]) if parsed else None)


def math_verify_grade(response: str | None, *, label: str) -> tuple[float, str | None]:
    """Grade a response against ``label`` as math-verify grades it.

    math-verify extracts the answer from the whole response (``\\boxed{}`` and ``final answer
    is`` phrases first, then ``Answer:`` phrases, then the last LaTeX or plain expression), or from
    the last ``<answer>...</answer>`` tag's content when the response has one. The label is read
    as one expression (``_mv_parse`` with ``bare``). When either side parses to nothing, the
    extracted text is compared with the label as a string.

    Returns:
        (1.0 when equivalent else 0.0, the answer text math-verify extracted: None when none).
    """
    if response is None:
        return 0.0, None
    from math_verify import verify

    tags = _TAG.findall(response)
    pred = _mv_parse(tags[-1].strip(), bare=True) if tags else _mv_parse(response, bare=False)
    extracted = _mv_text(pred) if pred else (tags[-1].strip() if tags else None)
    gold = _mv_parse(label.strip(), bare=True)
    if not gold or not pred:
        return float(extracted is not None and extracted.strip() == label.strip()), extracted
    return float(verify(gold, pred, timeout_seconds=None)), extracted


def grade_math_verify(response: str | None, *, label: str) -> float:
    """1.0 when math-verify finds the answer of ``response`` equivalent to ``label``, else 0.0
    (``math_verify_grade``)."""
    return math_verify_grade(response, label=label)[0]


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
        score, answer = math_verify_grade(response, label=label)
    else:
        raise ValueError(f"unknown grader {grader!r}; valid: dataset, math_verify")
    reward = correct_reward * score + format_reward * float(formatted)
    return RewardResult(reward, score >= 1.0, answer, {"correctness": score, "format": float(formatted)})


# --- reward sources --------------------------------------------------------------------------

def _math_verify_worker(response: str | None, label: str) -> tuple[float, str | None]:
    """Runs in a pool worker process (module-level so spawn can import it)."""
    return math_verify_grade(response, label=label)


def grade_math_verify_batch(pairs: list[tuple[str | None, str]], *, timeout_s: float,
                            max_workers: int = 1) -> list[tuple[float, str | None, str | None]]:
    """math-verify (``math_verify_grade``) on many (response, label) pairs, each under a
    wall-time limit; extraction runs in the worker too (parsing can be what hangs).

    math-verify's own timeout uses ``signal.alarm``, which only works on the main thread (Prefect
    runs tasks in worker threads). Here each pair runs in a ``pebble`` worker process; one that
    passes ``timeout_s`` is killed and replaced, and the pair scores 0 with the reason.

    Returns:
        [(score 0/1, extracted answer or None, reason or None)], in order.
    """
    import multiprocessing

    from pebble import ProcessPool

    out: list[tuple[float, str | None, str | None]] = []
    with ProcessPool(max_workers=max_workers, context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.schedule(_math_verify_worker, args=(a, lab), timeout=timeout_s) for a, lab in pairs]
        for fut in futures:
            try:
                score, extracted = fut.result()
                out.append((float(score), extracted, None))
            except TimeoutError:
                out.append((0.0, None, f"math_verify timeout after {timeout_s:g} s"))
    return out


class MathAnswerReward:
    """Source ``math_answer``: 1.0 when the final answer matches the reference.

    The grader is the dataset's own (reasoning-gym ``score_answer``, fractional scores possible,
    on the answer ``extract_answer`` cuts out) or math-verify (its own extraction from the
    response or the ``<answer>`` tag, ``\\boxed{}`` included, and symbolic equivalence:
    ``1/2`` = ``0.5`` = ``\\frac{1}{2}``), the latter in worker processes with a per-sample
    wall-time limit. ``extracted`` is the answer the grader graded; ``extras['format']`` says
    whether the response has an ``Answer:`` line or an ``<answer>`` tag.
    """

    def __init__(self, cfg, name: str = "math_answer") -> None:
        self.cfg, self.name = cfg, name

    def score(self, samples):
        if self.cfg.grader == "math_verify":
            graded = grade_math_verify_batch([(s.response, s.reference) for s in samples], timeout_s=self.cfg.timeout_s)
            return [SourceScore(score, score >= 1.0, a, reason, {"format": float(extract_answer(s.response)[1])})
                    for s, (score, a, reason) in zip(samples, graded)]
        for label in sorted({s.label for s in samples}):
            try:
                _rg_scorer(label)
            except Exception as exc:
                raise RewardError(f"grader 'dataset' grades with the reasoning-gym dataset named by the sample's label; "
                                  f"{label!r} is not one ({exc}); use grader: math_verify") from exc
        out = []
        for s in samples:
            r = score_response(s.response, source=s.label, question=s.question, label=s.reference,
                               metadata_json=json.dumps(s.metadata, sort_keys=True), grader="dataset")
            out.append(SourceScore(r.reward, r.correct, r.extracted, None, {"format": r.metrics.get("format", 0.0)}))
        return out


class FormatReward:
    """Source ``format``: 1.0 when the response gives its answer in an ``Answer:`` line or an
    ``<answer>...</answer>`` tag, else 0.0."""

    def __init__(self, cfg, name: str = "format") -> None:
        self.cfg, self.name = cfg, name

    def score(self, samples):
        return [SourceScore(float(extract_answer(s.response)[1])) for s in samples]


class ExactMatchReward:
    """Source ``exact_match``: 1.0 when the extracted final answer (``extract_answer``) equals
    the reference after stripping whitespace (and case, with ``ignore_case``), else 0.0."""

    def __init__(self, cfg, name: str = "exact_match") -> None:
        self.cfg, self.name = cfg, name

    def score(self, samples):
        out = []
        for s in samples:
            answer, formatted = extract_answer(s.response)
            a, ref = (answer or "").strip(), s.reference.strip()
            hit = answer is not None and (a.lower() == ref.lower() if self.cfg.ignore_case else a == ref)
            out.append(SourceScore(float(hit), hit, answer, None, {"format": float(formatted)}))
        return out
