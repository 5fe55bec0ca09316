"""The reward engine: recipes per label, weighted sums and user aggregation, sources only seeing
the samples that need them, user functions, math answers in several forms, and bad input
(NaN, wrong counts, raising functions, missing recipes) as clear errors or counted fallbacks."""
from __future__ import annotations

import math
import time

import pytest

from rft_core.config import ConfigError, MathAnswerSource, RewardConfig, load_config
from rft_core.rewards.base import RewardError, RewardSample
from rft_core.rewards.engine import RewardEngine
from rft_core.rewards.math import MathAnswerReward, grade_math_verify_batch
from rft_core.rewards.user import load_function

# --- user functions used by the configs below (importable as tests.rft_core.rewards.test_rewards_engine:...)
CALLS: dict[str, list[str]] = {}


def length_score(sample):
    CALLS.setdefault("length", []).append(sample.sample_id)
    return len(sample.response) / 10


def reasoned(sample):
    return (0.5, "half credit") if "maybe" in sample.response else 1.0


def as_dict(sample):
    return {"score": 2.0, "correct": sample.response == sample.reference, "tokens": 3}


def nan_for_x(sample):
    return float("nan") if sample.response == "x" else 1.0


def raises_for_x(sample):
    if sample.response == "x":
        raise ZeroDivisionError("division by zero")
    return 1.0


def batch_short(samples):
    return [1.0] * (len(samples) - 1)


def lightrft_style(queries, prompts, labels):
    return [len(q) - len(p) for q, p in zip(queries, prompts)]


def product(scores, weights, sample):
    return math.prod(scores[k] * weights[k] for k in scores)


def _s(i, response, label="basic_arithmetic", reference="4"):
    return RewardSample(sample_id=f"s{i}", prompt_id=f"p{i}", label=label, question="2+2?", prompt_text="Q: ",
                        response=response, reference=reference, metadata={})


def _engine(**reward):
    return RewardEngine(load_config(None, {**{f"reward.{k}": v for k, v in reward.items()}}).reward)


M = "tests.rft_core.rewards.test_rewards_engine"


def test_recipes_per_label_weighted_sum_and_routing():
    CALLS.clear()
    eng = _engine(sources={"ans": {"type": "math_answer"}, "fmt": {"type": "format"},
                           "len": {"type": "python", "function": f"{M}:length_score"}},
                  recipes={"basic_arithmetic": [{"source": "ans", "weight": 1.0}, {"source": "fmt", "weight": 0.25}],
                           "chat": [{"source": "len", "weight": 2.0}]})
    samples = [_s(0, "Answer: 4"), _s(1, "it is 5"), _s(2, "hello", label="chat"), _s(3, "<answer>4</answer>")]
    out = eng.score(samples).results
    # math: 1*correct + 0.25*format; chat: 2 * len/10
    assert [r.reward for r in out] == pytest.approx([1.25, 0.0, 1.0, 1.25])
    assert [r.correct for r in out] == [True, False, False, True]  # chat: no source judges correctness
    assert [r.recipe for r in out] == ["basic_arithmetic"] * 2 + ["chat", "basic_arithmetic"]
    assert out[0].metrics == {"ans": 1.0, "ans.format": 1.0, "fmt": 1.0} and out[0].extracted == "4"
    assert out[2].metrics == {"len": 0.5}
    assert CALLS["length"] == ["s2"]  # the chat-only source saw only the chat sample


def test_implicit_recipe_keeps_the_shorthand_behaviour():
    eng = RewardEngine(RewardConfig(format_reward=0.1))
    out = eng.score([_s(0, "Answer: 4"), _s(1, "4"), _s(2, "Answer: 3")]).results
    assert [r.reward for r in out] == pytest.approx([1.1, 1.0, 0.1])
    assert out[1].metrics == {"correctness": 1.0, "correctness.format": 0.0, "format": 0.0}


def test_user_function_forms_and_aggregation():
    eng = _engine(sources={"a": {"type": "python", "function": f"{M}:reasoned"},
                           "b": {"type": "python", "function": f"{M}:as_dict"},
                           "c": {"type": "python", "function": f"{M}:lightrft_style", "call": "lightrft"}},
                  recipes={"basic_arithmetic": [{"source": "a", "weight": 2.0}, {"source": "b", "weight": 0.5},
                                    {"source": "c", "weight": 1.0}]},
                  aggregation=f"{M}:product")
    out = eng.score([_s(0, "maybe 4", reference="maybe 4"), _s(1, "4!")]).results
    # product of weighted scores: (2*0.5) * (0.5*2) * (1*len(response)) ; (2*1) * (0.5*2) * 2
    assert [r.reward for r in out] == pytest.approx([1.0 * 1.0 * 7, 2.0 * 1.0 * 2])
    assert out[0].reasons == {"a": "half credit"} and out[0].metrics["b.tokens"] == 3.0
    assert [r.correct for r in out] == [True, False]


def test_user_function_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def score(sample):\n    return 3.0 if sample.response.endswith('!') else 0.0\n")
    monkeypatch.chdir(tmp_path)
    eng = _engine(sources={"mine": {"type": "python", "function": "my_reward.py:score"}},
                  recipes={"basic_arithmetic": [{"source": "mine"}]})
    assert [r.reward for r in eng.score([_s(0, "yes!"), _s(1, "no")]).results] == [3.0, 0.0]
    with pytest.raises(RewardError, match=r"'nope.py:score'.*does not exist"):
        load_function("nope.py:score")
    with pytest.raises(RewardError, match=r"'json:nope'.*has no callable 'nope'"):
        load_function("json:nope")
    with pytest.raises(RewardError, match=r"cannot import 'no_such_module_xyz'"):
        load_function("no_such_module_xyz:f")


@pytest.mark.parametrize("fn, why", [("nan_for_x", "returned nan, not a finite number"),
                                     ("raises_for_x", "ZeroDivisionError: division by zero")])
def test_bad_scores_raise_or_fall_back_counted(fn, why):
    sources = {"u": {"type": "python", "function": f"{M}:{fn}"}}
    recipes = {"basic_arithmetic": [{"source": "u", "weight": 1.0}]}
    with pytest.raises(RewardError, match=rf"reward source 'u' on sample s1: {why}"):
        _engine(sources=sources, recipes=recipes).score([_s(0, "ok"), _s(1, "x")])
    eng = _engine(sources={"u": {**sources["u"], "on_error": "fallback", "fallback": -1.0}}, recipes=recipes)
    batch = eng.score([_s(0, "ok"), _s(1, "x"), _s(2, "x")])
    assert [r.reward for r in batch.results] == [1.0, -1.0, -1.0]
    assert batch.results[1].metrics == {"u": -1.0, "u.fallback": 1.0}
    assert batch.results[1].reasons["u"].startswith("fallback -1: ") and why in batch.results[1].reasons["u"]
    assert batch.fallbacks == 2 and batch.source_stats["u"] == {"n": 3.0, "mean": pytest.approx(-1 / 3), "fallbacks": 2.0}


def test_wrong_number_of_scores_is_an_error():
    eng = _engine(sources={"u": {"type": "python", "function": f"{M}:batch_short", "call": "batch"}},
                  recipes={"basic_arithmetic": [{"source": "u"}]})
    with pytest.raises(RewardError, match=r"reward source 'u' failed on 3 samples \(first s0\).*got 3 samples, returned 2 scores"):
        eng.score([_s(0, "a"), _s(1, "b"), _s(2, "c")])


def test_missing_recipe_for_a_label():
    kw = dict(sources={"f": {"type": "format"}}, recipes={"basic_arithmetic": [{"source": "f"}]})
    with pytest.raises(RewardError, match=r"no reward recipe for label\(s\) \['code'\]; recipes: basic_arithmetic"):
        _engine(**kw).score([_s(0, "a"), _s(1, "b", label="code")])
    out = _engine(**kw, default_recipe="basic_arithmetic").score([_s(1, "Answer: b", label="code")]).results
    assert out[0].recipe == "basic_arithmetic" and out[0].reward == 1.0


def test_config_errors_name_the_bad_key():
    with pytest.raises(ConfigError, match="uses source 'nope', which is not in reward.sources"):
        load_config(None, {"reward.sources": {"f": {"type": "format"}}, "reward.recipes": {"m": [{"source": "nope"}]}})
    with pytest.raises(ConfigError, match="unknown reward source type; valid names: math_answer, exact_match, format, code_exec"):
        load_config(None, {"reward.sources": {"f": {"type": "codex"}}, "reward.recipes": {"m": [{"source": "f"}]}})
    with pytest.raises(ConfigError, match="function must be 'module:function'"):
        load_config(None, {"reward.sources": {"f": {"type": "python", "function": "nocolon"}},
                           "reward.recipes": {"m": [{"source": "f"}]}})
    with pytest.raises(ConfigError, match="url must start with http"):
        load_config(None, {"reward.sources": {"r": {"type": "remote", "url": "localhost:80"}},
                           "reward.recipes": {"m": [{"source": "r"}]}})
    with pytest.raises(ConfigError, match="give weights in reward.recipes instead"):
        load_config(None, {"reward.format_reward": 0.1, "reward.sources": {"f": {"type": "format"}},
                           "reward.recipes": {"m": [{"source": "f"}]}})


def test_non_finite_aggregate_is_an_error():
    eng = _engine(sources={"f": {"type": "format"}}, recipes={"basic_arithmetic": [{"source": "f", "weight": float("inf")}]})
    with pytest.raises(RewardError, match=r"reward of sample s0 is nan"):
        eng.score([_s(0, "no format")])  # inf * 0


def test_math_verify_forms():
    cases = [("0.5", "1/2", 1.0), ("\\frac{1}{2}", "0.5", 1.0), ("$\\boxed{12}$", "12", 1.0), ("12.0", "12", 1.0),
             ("$x^2+2x+1$", "$(x+1)^2$", 1.0), ("13", "12", 0.0), (None, "12", 0.0), ("$\\sqrt{4}$", "2", 1.0),
             ("1,000", "1000", 1.0), ("$\\frac{3}{4}$", "0.74", 0.0)]
    got = grade_math_verify_batch([(a, lab) for a, lab, _ in cases], timeout_s=30)
    assert [(score, reason) for score, _, reason in got] == [(score, None) for _, _, score in cases]


# (response, label, score, what math-verify extracted): math-verify extracts from the whole
# response, \boxed{} first; an <answer> tag's content is graded when there is one
MATH_VERIFY_RESPONSES = [
    ("The result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0, "\\frac{1}{2}"),  # the regex took "2" here
    ("So $x = \\dfrac{3}{4}$, thus \\boxed{\\dfrac{3}{4}}", "0.75", 1.0, "\\frac{3}{4}"),
    ("\\boxed{\\dfrac{3}{4}}", "\\dfrac{3}{4}", 1.0, "\\frac{3}{4}"),  # a LaTeX label without $ reads whole
    ("\\boxed{2}", "2\\sqrt{2}", 0.0, "2"),
    ("The answer is \\boxed{50\\%}", "50", 1.0, "50\\%"),
    ("The answer is \\boxed{50\\%}", "0.5", 1.0, "50\\%"),
    ("The price rose by 25%.", "25", 1.0, "25"),
    ("\\boxed{7}. Let me double check: 3 + 4 = 7, and 2 + 2 = 4.", "7", 1.0, "7"),  # boxed, then more text
    ("\\boxed{\\frac{1}{2}} is what I get, though 0.4 seemed close", "0.5", 1.0, "\\frac{1}{2}"),
    ("12", "12", 1.0, "12"),
    ("First 3, then 1,234", "1234", 1.0, "1234"),
    ("so it is 12, no wait 13\nAnswer: 12", "12", 1.0, "12"),
    ("13", "12", 0.0, "13"),
    ("<answer>\\dfrac{1}{2}</answer> and later 7", "0.5", 1.0, "\\frac{1}{2}"),
    ("<answer>2\\sqrt{2}</answer>", "2\\sqrt{2}", 1.0, "2\\sqrt{2}"),
    ("<answer> 12 apples </answer>", "12", 1.0, "12"),
    ("<answer>0.4</answer> though \\boxed{0.5}", "0.5", 0.0, "0.4"),
    ("no number here", "4", 0.0, None),
]


@pytest.mark.parametrize("response, label, score, extracted", MATH_VERIFY_RESPONSES)
def test_math_verify_grades_its_own_extraction(response, label, score, extracted):
    from rft_core.rewards.math import math_verify_grade, score_response

    assert math_verify_grade(response, label=label) == (score, extracted)
    r = score_response(response, source="math", question="q", label=label, metadata_json="{}", grader="math_verify",
                       format_reward=0.1)
    assert (r.correct, r.extracted, r.metrics["correctness"]) == (score == 1.0, extracted, score)


def test_math_answer_source_with_math_verify_off_the_main_thread():
    import threading

    src = MathAnswerReward(MathAnswerSource(grader="math_verify", timeout_s=30))
    got = {}
    samples = [_s(0, "Answer: \\frac{8}{2}"), _s(1, "so 5"), _s(2, "The result is \\boxed{\\frac{1}{2}}.", reference="0.5"),
               _s(3, "<answer>4</answer>")]
    t = threading.Thread(target=lambda: got.update(r=src.score(samples)))
    t.start()
    t.join(60)
    r = got["r"]
    assert [(x.score, x.correct, x.extracted) for x in r] == [(1.0, True, "\\frac{8}{2}"), (0.0, False, "5"),
                                                              (1.0, True, "\\frac{1}{2}"), (1.0, True, "4")]
    assert [x.extras for x in r] == [{"format": 1.0}, {"format": 0.0}, {"format": 0.0}, {"format": 1.0}]


def test_rewards_shard_extracted_answer_is_what_math_verify_graded(tmp_path):
    """The rewards stage writes math-verify's extraction (not the regex's) in extracted_answer."""
    import pyarrow as pa

    from rft_core import stages
    from rft_core.stages.contracts import RewardsInput
    from schemas import read_shard, write_shard
    from schemas.columns import PROMPTS, ROLLOUT, policy_version_column, single_turn_columns

    responses = ["The result is \\boxed{\\frac{1}{2}}.", "I get 0.25, so \\boxed{\\dfrac{1}{4}}"]
    n = len(responses)
    prompts = pa.table({"prompt_id": ["p0"], "data_source": ["math"], "question": ["q"], "prompt_text": ["q"],
                        "prompt_token_ids": [[1]], "answer": ["0.5"], "metadata_json": ["{}"], "images": [[]],
                        "videos": [[]]}, schema=PROMPTS.arrow)
    rollout = pa.table({"sample_id": [f"s{i}" for i in range(n)], "prompt_id": ["p0"] * n, "sample_index": list(range(n)),
                        "prompt_token_ids": [[1]] * n, "response_token_ids": [[2]] * n, "response_text": responses,
                        "rollout_logprobs": [[0.0]] * n, "action_mask": [[True]] * n, "finish_reason": ["stop"] * n,
                        "images": [[]] * n, "videos": [[]] * n, **single_turn_columns(responses),
                        **policy_version_column(n, 0)}, schema=ROLLOUT.arrow)
    p = write_shard(prompts, str(tmp_path / "prompts"), schema=PROMPTS, config_hash="p")
    r = write_shard(rollout, str(tmp_path / "rollout"), schema=ROLLOUT, config_hash="r")
    reward = load_config(None, {"reward.grader": "math_verify", "reward.format_reward": 0.1}).reward
    w = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward, out=str(tmp_path / "rewards")))
    rows = read_shard(w, stage="rewards").to_pylist()
    assert [(x["extracted_answer"], x["correct"], x["rewards"]) for x in rows] == [
        ("\\frac{1}{2}", True, 1.0), ("\\frac{1}{4}", False, 0.0)]  # the regex extracted "2" and "4"


def _slow_verify(answer, label):  # stands in for a pathological sympy parse
    import time as _t

    _t.sleep(30)
    return 1.0


def test_math_verify_timeout_kills_the_worker(monkeypatch):
    import rft_core.rewards.math as m

    monkeypatch.setattr(m, "_math_verify_worker", _slow_verify)
    t0 = time.perf_counter()
    out = grade_math_verify_batch([("1", "1")], timeout_s=1.0)
    assert out == [(0.0, None, "math_verify timeout after 1 s")]
    assert time.perf_counter() - t0 < 15  # spawn start-up + 1 s, never the 30 s sleep


def test_exact_match_source():
    eng = _engine(sources={"em": {"type": "exact_match"}}, recipes={"basic_arithmetic": [{"source": "em"}]})
    out = eng.score([_s(0, "The digit is 7.\nAnswer: 7", reference="7"), _s(1, "Answer: Seven", reference="seven"),
                     _s(2, "8", reference="7"), _s(3, "no idea", reference="7")]).results
    assert [r.reward for r in out] == [1.0, 1.0, 0.0, 0.0]
    assert [r.extracted for r in out] == ["7", "Seven", "8", None]
    assert out[0].metrics == {"em": 1.0, "em.format": 1.0}


def test_code_fingerprints_cover_the_user_functions_source(tmp_path, monkeypatch):
    import hashlib

    from rft_core.rewards.user import code_fingerprints, source_fingerprint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "fp_reward.py").write_text("def score(sample):\n    return 1.0\n")
    cfg = load_config(None, {"reward.sources": {"mine": {"type": "python", "function": "fp_reward.py:score"},
                                                "m": {"type": "math_answer"}},
                             "reward.recipes": {"x": [{"source": "mine"}, {"source": "m"}]},
                             "reward.aggregation": f"{M}:product"}).reward
    this_file = hashlib.sha256(open(__file__, "rb").read()).hexdigest()
    first = code_fingerprints(cfg)
    assert first == {"fp_reward.py:score": hashlib.sha256(b"def score(sample):\n    return 1.0\n").hexdigest(),
                     f"{M}:product": this_file}
    (tmp_path / "fp_reward.py").write_text("def score(sample):\n    return 2.0\n")
    assert code_fingerprints(cfg)["fp_reward.py:score"] != first["fp_reward.py:score"]
    assert code_fingerprints(RewardConfig()) == {}  # no user code: the hash is as before
    with pytest.raises(RewardError, match="no Python source file"):
        source_fingerprint("math:sqrt")


def test_editing_a_user_reward_function_makes_the_committed_rewards_shard_stale(tiny_model, tmp_path, monkeypatch):
    from rft_core import stages
    from rft_core.stages.contracts import PromptsInput, RewardsInput, RolloutInput
    from schemas import stage_uri
    from schemas.shards import StaleShardError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "edit_reward.py").write_text("def score(sample):\n    return 1.0\n")
    cfg = load_config(None, [f"policy.path={tiny_model}", "data.prompts_per_iteration=2", "rollout.n_samples_per_prompt=2",
                             "rollout.max_new_tokens=3"])
    reward = load_config(None, {"reward.sources": {"mine": {"type": "python", "function": "edit_reward.py:score"}},
                                "reward.recipes": {"r": [{"source": "mine"}]}, "reward.default_recipe": "r"}).reward
    root = str(tmp_path / "run")
    p = stages.prompts.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=stage_uri(root, 1, "prompts")))
    r = stages.rollout.run(RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1, out=stage_uri(root, 1, "rollout")))
    out = stage_uri(root, 1, "rewards")
    first = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward, out=out))
    assert stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward, out=out)) == first  # unchanged code: reused
    (tmp_path / "edit_reward.py").write_text("def score(sample):\n    return 0.0  # edited\n")
    with pytest.raises(StaleShardError, match="config hash"):
        stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward, out=out))
