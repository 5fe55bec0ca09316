"""avg@n, pass@k and maj@n against hand-computed cases and float64 / exact reference loops:
pass@k by enumerating every k-subset, the stable product form where the binomial ratio
overflows a float, majority votes with ties, and the standard errors across prompts."""
from __future__ import annotations

import math
import statistics
from fractions import Fraction
from itertools import combinations

import pytest

from rft_core.evaluation.metrics import (
    CORRECT,
    PromptAnswers,
    majority_credit,
    mean_stderr,
    metrics_block,
    normalise_answer,
    pass_at_k,
    sampled_metrics,
    shown_ks,
    vote_key,
)


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 1, 3, 0.75), (4, 1, 4, 1.0),  # 1 - C(3,k)/C(4,k)
    (5, 2, 3, 0.9),                      # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 2, 24 / 45),                 # 1 - C(7,2)/C(10,2) = 1 - 21/45
    (8, 0, 8, 0.0), (8, 8, 1, 1.0),      # none / all correct
    (8, 6, 3, 1.0),                      # n - c = 2 < k: every 3-subset holds a correct answer
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_pass_at_k_is_the_mean_over_every_k_subset():
    """The estimator is the exact mean, over all C(n, k) subsets of the n answers, of 'some answer
    in the subset is correct' (Chen et al. 2021, eq. 1): enumerated here for every n <= 8, every
    c and k, and for two arrangements of the correct answers (the order must not matter)."""
    for n in range(1, 9):
        for c in range(n + 1):
            for correct in ([True] * c + [False] * (n - c), [i % 2 == 0 for i in range(n)][:n]):
                if sum(correct) != c:
                    continue
                for k in range(1, n + 1):
                    subsets = list(combinations(range(n), k))
                    exact = Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))
                    assert exact == 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                    assert abs(pass_at_k(n, c, k) - float(exact)) < 1e-15, (n, c, k)


def test_pass_at_k_product_form_where_the_binomials_overflow_a_float():
    n, c, k = 2000, 5, 1000
    with pytest.raises(OverflowError):
        float(math.comb(n, k))  # the ratio of float binomials cannot even be formed
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-13)
    assert 0.96 < pass_at_k(n, c, k) < 0.97  # 1 - (1/2)^5 roughly: each correct answer lands in half the subsets


def test_pass_at_1_is_the_mean_accuracy():
    for n in range(1, 20):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)


def test_normalise_answer_and_vote_keys():
    same = ["1,000", "1000", " $1000$ ", "1000.", "1000.00", "+1000"]
    assert {normalise_answer(a) for a in same} == {"1000"}
    assert normalise_answer("-0.50") == "-0.5" and normalise_answer("-0") == "0" and normalise_answer("0.50") == "0.5"
    assert normalise_answer("\\frac{1}{2}") == "\\frac{1}{2}" and normalise_answer("x  =  3") == "x = 3"
    assert vote_key(True, "0.5") == vote_key(True, None) == CORRECT  # graded correct: one class
    assert vote_key(False, "12.0") == "12" and vote_key(False, None) is None and vote_key(False, "  ") is None


@pytest.mark.parametrize("keys, expected", [
    ([CORRECT, CORRECT, "5"], 1.0),                   # correct majority
    (["5", "5", CORRECT], 0.0),                       # a wrong answer wins
    ([CORRECT, "5"], 0.5),                            # two classes tied: a random tie-break is right half the time
    ([CORRECT, "5", "6"], 1 / 3),                     # three tied
    (["5", "5", "6", "6", CORRECT], 0.0),             # tied wrong classes above the correct one
    ([CORRECT, CORRECT, "5", "5", "6"], 0.5),
    ([CORRECT, None, None], 1.0),                     # answers with nothing extracted do not vote
    ([None, None], 0.0),                              # nothing voted
])
def test_majority_credit_with_ties(keys, expected):
    assert majority_credit(keys) == pytest.approx(expected, abs=1e-15)
    assert majority_credit(list(reversed(keys))) == majority_credit(keys)  # order independent


def test_equivalent_correct_answers_vote_together_and_wrong_ones_by_normalised_text():
    # "1/2" and "0.5" are both graded correct: one class of 2, against "3" twice -> tie, 1/2
    keys = [vote_key(ok, x) for ok, x in ((True, "1/2"), (True, "0.5"), (False, "3"), (False, "3.0"))]
    assert majority_credit(keys) == 0.5
    # raw strings would split the wrong answers too; normalised, "1,200" and "1200" are one wrong class
    keys = [vote_key(ok, x) for ok, x in ((True, "7"), (True, "7"), (False, "1,200"), (False, "1200"), (False, "1200.0"))]
    assert majority_credit(keys) == 0.0


def _stderr(values):
    return statistics.stdev(values) / math.sqrt(len(values))


def test_metrics_block_by_hand():
    prompts = [
        PromptAnswers("a", (True, True, True, True), ("7", "7", "7.0", "7")),
        PromptAnswers("a", (True, False, False, False), ("7", "8", "8", "9")),      # 8 wins the vote
        PromptAnswers("b", (False, False, False, False), ("3", "4", None, None)),
    ]
    m = metrics_block(prompts)
    assert (m["num_prompts"], m["n_samples"]) == (3, 4)
    acc = [1.0, 0.25, 0.0]
    assert m["avg@4"] == pytest.approx(1.25 / 3, abs=1e-15) and m["avg@4_stderr"] == pytest.approx(_stderr(acc), abs=1e-15)
    per_k = {1: [1, 0.25, 0], 2: [1, 0.5, 0], 3: [1, 0.75, 0], 4: [1, 1, 0]}  # 1 - C(3,k)/C(4,k) for c = 1
    for k, vals in per_k.items():
        assert m[f"pass@{k}"] == pytest.approx(sum(vals) / 3, abs=1e-15)
        assert m[f"pass@{k}_stderr"] == pytest.approx(_stderr(vals), abs=1e-15)
    assert m["maj@4"] == pytest.approx(1 / 3, abs=1e-15) and m["maj@4_stderr"] == pytest.approx(_stderr([1, 0, 0]))
    assert "pass@5" not in m


def test_metrics_overall_and_per_data_source():
    import random

    rng = random.Random(7)
    prompts = []
    for i in range(7):
        correct = tuple(rng.random() < 0.4 for _ in range(5))
        prompts.append(PromptAnswers("gsm8k" if i < 5 else "aime", correct,
                                     tuple(("42" if ok else rng.choice(["1", "2", None])) for ok in correct)))
    m = sampled_metrics(prompts)
    assert list(m["by_data_source"]) == ["aime", "gsm8k"]
    assert m["by_data_source"]["gsm8k"] == metrics_block(prompts[:5])
    assert m["by_data_source"]["aime"] == metrics_block(prompts[5:])
    assert m["overall"] == metrics_block(prompts)
    # the overall mean is over prompts, not the mean of the two sources' means (5 vs 2 prompts)
    for name in ("avg@5", "pass@3", "maj@5"):
        g, a = m["by_data_source"]["gsm8k"][name], m["by_data_source"]["aime"][name]
        assert m["overall"][name] == pytest.approx((5 * g + 2 * a) / 7, abs=1e-15)


def test_one_prompt_has_no_standard_error_and_bad_groups_are_refused():
    assert mean_stderr([0.5]) == (0.5, None)
    m = metrics_block([PromptAnswers("a", (True, False), ("1", "2"))])
    assert m["avg@2"] == 0.5 and m["avg@2_stderr"] is None and m["pass@2"] == 1.0
    with pytest.raises(ValueError, match="same number of answers"):
        metrics_block([PromptAnswers("a", (True, False), ("1", "2")), PromptAnswers("a", (True,), ("1",))])
    with pytest.raises(ValueError, match="no prompts"):
        metrics_block([])


def test_shown_ks():
    assert shown_ks(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert shown_ks(64) == [1, 2, 4, 8, 16, 32, 64] and shown_ks(20) == [1, 2, 4, 8, 16, 20]
