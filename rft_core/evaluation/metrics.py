"""Metrics of n sampled answers per prompt, as papers report them: avg@n, pass@k (k = 1..n) and
maj@n, each with a standard error, overall and per ``data_source``.

Per prompt i with n graded answers of which c_i are correct:

- **avg@n** (``mean@N`` in verl): the mean accuracy, a_i = c_i / n.
- **pass@k**: the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, eq. 1) of the
  probability that at least one of k answers drawn without replacement from the n is correct,
  p_i(k) = 1 - C(n - c_i, k) / C(n, k), computed in the paper's numerically stable product form
  1 - prod_{j = n - c_i + 1}^{n} (1 - k / j) (``pass_at_k``). It is exact for every k <= n,
  where verl's ``best@N`` is a bootstrap (sampling with replacement) estimate.
- **maj@n**: majority vote over the n graded answers (``majority_credit``): the answers the
  grader judged correct are one vote class (each is equivalent to the reference, so to each
  other); a wrong answer votes for its extracted answer, normalised (``normalise_answer``:
  whitespace collapsed, ``$`` and a trailing period stripped, commas between digits removed,
  a plain decimal number written without trailing zeros); a wrong answer with nothing
  extracted does not vote. The prompt scores 1 when the correct class alone has the most
  votes, 0 when it is not among the most voted classes (or nothing voted), and 1/m when it is
  one of m classes tied for the most votes: the expected score of a uniformly random
  tie-break, independent of the order the answers were sampled in.

  Where this departs from verl (``verl/trainer/ppo/metric_utils.py``, ``calc_maj_val`` and
  ``process_validation_metrics`` at commit 07c9cf13): verl votes on the raw ``pred`` strings
  (``1/2`` and ``0.5`` are two votes even when both are graded correct), breaks a tie by the
  first-inserted answer (order dependent), and reports ``maj@N`` as the mean of 1000 bootstrap
  resamples of size N drawn with replacement (for N = n not the vote of the n answers). Here
  maj@n is the vote of the n answers themselves, deterministic.

Standard errors are across prompts, the prompt being the unit that was sampled (Miller 2024,
"Adding Error Bars to Evals", arXiv:2411.00640: average the answers of a question first): for
each metric, the per-prompt values x_i (a_i, p_i(k) or the maj score) give
SE = sd(x, ddof=1) / sqrt(P) over the P prompts; None for a single prompt. The within-prompt
sampling noise of a_i and p_i(k) is part of sd(x), so nothing is counted twice or left out.
verl's ``std@N`` / ``best@N/std`` are spreads within a prompt averaged over prompts, not
standard errors of the reported means.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

CORRECT = "\x00correct"  # the vote class of the answers graded correct (no extracted text equals it)
_PLAIN_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct answers among ``n`` (Chen et al. 2021,
    arXiv:2107.03374, eq. 1): 1 - C(n-c, k) / C(n, k), in float64 as the product
    1 - prod_{j=n-c+1}^{n} (1 - k/j) (the paper's numerically stable form, its Figure 3), 1.0
    when n - c < k (every k-subset holds a correct answer).

    Raises:
        ValueError: not 0 <= c <= n, or not 1 <= k <= n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for j in range(n - c + 1, n + 1):
        prod *= 1.0 - k / j
    return 1.0 - prod


def normalise_answer(text: str) -> str:
    """An extracted answer as a vote key: whitespace collapsed, surrounding ``$`` and a trailing
    period stripped, commas between digits removed, and a plain decimal number without a
    leading ``+`` or trailing zeros (``"1,000.50"`` -> ``"1000.5"``, ``"12.0"`` -> ``"12"``,
    ``"-0"`` -> ``"0"``). Anything else is kept as it is (no symbolic equivalence)."""
    t = " ".join(text.split()).strip("$ ").rstrip(".").strip()
    t = re.sub(r"(?<=\d),(?=\d)", "", t)
    if _PLAIN_NUMBER.fullmatch(t):
        sign = "-" if t.startswith("-") else ""
        body = t.lstrip("+-")
        if "." in body:
            body = body.rstrip("0").rstrip(".")
        body = body.lstrip("0") or "0"
        if body.startswith("."):
            body = "0" + body
        t = "" if body == "0" else sign
        t += body
    return t


def vote_key(correct: bool, extracted: str | None) -> str | None:
    """The vote of one graded answer: ``CORRECT`` when graded correct, else its normalised
    extracted answer, else None (no vote)."""
    if correct:
        return CORRECT
    if extracted is None or not extracted.strip():
        return None
    return normalise_answer(extracted)


def majority_credit(keys: Sequence[str | None]) -> float:
    """maj score of one prompt from its answers' votes (``vote_key``): 1/m when the ``CORRECT``
    class is among the m classes with the most votes, else 0.0 (also when no answer voted)."""
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    tied = [k for k, v in counts.items() if v == top]
    return 1.0 / len(tied) if CORRECT in tied else 0.0


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """(mean, sd(ddof=1) / sqrt(len)) in float64; the standard error is None for one value.

    Raises:
        ValueError: no values.
    """
    n = len(values)
    if n == 0:
        raise ValueError("mean of no values")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, None
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


@dataclass(frozen=True)
class PromptAnswers:
    """The graded answers of one prompt.

    Attributes:
        data_source: the prompt's label (its grader's key).
        correct: per answer, whether the grader judged it correct.
        extracted: per answer, the answer the grader extracted (None: nothing).
    """

    data_source: str
    correct: tuple[bool, ...]
    extracted: tuple[str | None, ...]


def shown_ks(n: int) -> list[int]:
    """The k of pass@k shown in printed summaries: every k up to 16, else 1, 2, 4, ... and n
    (the manifest holds every k)."""
    if n <= 16:
        return list(range(1, n + 1))
    ks = [1 << j for j in range(n.bit_length()) if (1 << j) < n]
    return ks + [n]


def metrics_block(prompts: Sequence[PromptAnswers]) -> dict[str, Any]:
    """avg@n, pass@1..n and maj@n with standard errors over ``prompts`` (see the module
    docstring). Keys: ``num_prompts``, ``n_samples``, ``avg@{n}``, ``pass@{k}`` for k = 1..n,
    ``maj@{n}``, each metric with a ``{name}_stderr`` (None for one prompt).

    Raises:
        ValueError: no prompts, or prompts with different numbers of answers (or none).
    """
    if not prompts:
        raise ValueError("no prompts to score")
    n = len(prompts[0].correct)
    bad = next((p for p in prompts if len(p.correct) != n or len(p.extracted) != n), None)
    if n == 0 or bad is not None:
        raise ValueError(f"every prompt needs the same number of answers: {n} and {len(bad.correct) if bad else 0}")
    counts = [sum(p.correct) for p in prompts]
    out: dict[str, Any] = {"num_prompts": len(prompts), "n_samples": n}

    def put(name: str, values: Iterable[float]) -> None:
        out[name], out[f"{name}_stderr"] = mean_stderr(list(values))

    put(f"avg@{n}", (c / n for c in counts))
    for k in range(1, n + 1):
        put(f"pass@{k}", (pass_at_k(n, c, k) for c in counts))
    put(f"maj@{n}", (majority_credit([vote_key(ok, x) for ok, x in zip(p.correct, p.extracted)]) for p in prompts))
    return out


def sampled_metrics(prompts: Sequence[PromptAnswers]) -> dict[str, Any]:
    """``metrics_block`` over all prompts (``overall``) and over the prompts of each
    ``data_source`` (``by_data_source``, sorted by name).

    Raises:
        ValueError: see ``metrics_block``.
    """
    sources = sorted({p.data_source for p in prompts})
    return {"overall": metrics_block(prompts),
            "by_data_source": {s: metrics_block([p for p in prompts if p.data_source == s]) for s in sources}}
