"""The LLM judge (``type: llm_judge``) against an OpenAI-compatible server on 127.0.0.1
(``chat_server.ChatServer``; the client is the official ``openai`` one): the parse rules on
hand-computed replies, template and rule errors at config load, the cache key, a verdict per
sample in the rewards shard, an outage mid-run that fails the stage naming the endpoint and a
rerun that asks only for the rest, a rerun with the server stopped, fallbacks, the concurrency
bound, the client's retries and the API key."""
from __future__ import annotations

import hashlib
import json
import time

import pyarrow as pa
import pytest

from rft_core import stages
from rft_core.config import ConfigError, LLMJudgeSource, load_config
from rft_core.rewards.base import RewardError, RewardSample, SourceUnavailableError
from rft_core.rewards.judge import (
    VERDICTS_FOLDER,
    LLMJudgeReward,
    VerdictParseError,
    check_judge_keys,
    parse_score,
    sample_hash,
    template_hash,
    verdict_key,
)
from rft_core.stages.contracts import RewardsInput
from schemas import ShardNotCommittedError, ShardRef, read_manifest, read_shard, write_shard
from schemas.columns import PROMPTS, ROLLOUT, policy_version_column, single_turn_columns
from tests.rft_core.rewards.chat_server import ChatServer, response_of

URL = "http://judge.invalid:8000/v1"


def _judge(**kw) -> LLMJudgeSource:
    return LLMJudgeSource(**{"base_url": URL, "model": "judge-7b", **kw})


# --- the parse rules ------------------------------------------------------------------------

@pytest.mark.parametrize("reply, kw, want", [
    ("The answer matches.\nScore: 7", {}, 0.7),                       # (7 - 0) / (10 - 0)
    ("Score: 3 at first sight; on reflection\nScore: 8/10", {}, 0.8),  # the last match, "8/10" reads 8
    ("**Score:** 10", {}, 1.0),
    ("final score = 2.5", {}, 0.25),
    ("SCORE: 0", {}, 0.0),
    ("<think>Score: 1, no wait</think>Score: 9", {}, 0.9),             # reasoning blocks are left out
    ("Score: 7", {"normalize": False}, 7.0),
    ("Score: 4", {"score_range": (1, 5)}, 0.75),                       # (4 - 1) / (5 - 1)
    ("Score: -0.5", {"score_range": (-1, 1)}, 0.25),                   # (-0.5 + 1) / 2
    ("Rating: [[6]]", {"pattern": r"\[\[(\d+)\]\]"}, 0.6),             # MT-Bench's format
])
def test_number_rule_hand_computed(reply, kw, want):
    assert parse_score(reply, _judge(**kw)) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("reply, kw, match", [
    ("Score: 11", {}, r"score 11 is outside score_range \[0, 10\]"),
    ("Score: -1", {}, r"score -1 is outside score_range \[0, 10\]"),
    ("Looks right to me.", {}, "no score in the reply"),
    ("<think>Score: 9", {}, "no score in the reply"),  # an unclosed reasoning block runs to the end
    ("Score: 5", {"score_range": (6, 9)}, r"outside score_range \[6, 9\]"),
])
def test_number_rule_refusals(reply, kw, match):
    with pytest.raises(VerdictParseError, match=match):
        parse_score(reply, _judge(**kw))


LABELS = {"labels": {"CORRECT": 1.0, "INCORRECT": 0.0}, "parse": "label"}


@pytest.mark.parametrize("reply, kw, want", [
    ("The response is INCORRECT.", LABELS, 0.0),           # not read as CORRECT inside INCORRECT
    ("Not incorrect at all: it is Correct.", LABELS, 1.0),  # the last label, any case
    ("verdict: partially-correct", {"labels": {"partially-correct": 0.5, "correct": 1.0}, "parse": "label"}, 0.5),
    ("so \\boxed{True}", {"labels": {"True": 1.0, "False": 0.0}, "parse": "label", "pattern": r"\\boxed\{(\w+)\}"}, 1.0),
    ("<think>CORRECT</think> INCORRECT", LABELS, 0.0),
])
def test_label_rule_hand_computed(reply, kw, want):
    assert parse_score(reply, _judge(**kw)) == want


@pytest.mark.parametrize("reply, kw, match", [
    ("CORRECTNESS is unclear", LABELS, r"none of the labels \['CORRECT', 'INCORRECT'\]"),
    ("\\boxed{Maybe}", {"labels": {"True": 1.0, "False": 0.0}, "parse": "label", "pattern": r"\\boxed\{(\w+)\}"},
     r"label 'Maybe' is none of \['False', 'True'\]"),
])
def test_label_rule_refusals(reply, kw, match):
    with pytest.raises(VerdictParseError, match=match):
        parse_score(reply, _judge(**kw))


# --- config errors at load time -------------------------------------------------------------

def _load(**src):
    return load_config(None, {"reward.sources": {"judge": {"type": "llm_judge", "base_url": URL, "model": "m", **src}},
                              "reward.recipes": {"basic_arithmetic": [{"source": "judge"}]}})


@pytest.mark.parametrize("src, match", [
    ({"template": "Q: {question}\nA: {respons}"}, r"reward.sources.judge.template .*placeholder \{respons\}; a template "
                                                  r"may use only \{question\}, \{response\}, \{reference\}"),
    ({"template": "{} {response}"}, r"placeholder \{\}"),
    ({"template": "{response.upper}"}, r"placeholder \{response.upper\}"),
    ({"template": "{response!r}"}, r"placeholder \{response!r\}"),
    ({"template": "{response"}, r"expected '\}'.*literal braces"),
    ({"template": "Q: {question}"}, r"no \{response\} placeholder"),
    ({"parse": "label"}, "parse: label needs labels"),
    ({"labels": {"yes": 1}}, "labels are read only with parse: label"),
    ({"parse": "label", "labels": {"Yes": 1, "yes": 0}}, "differ only in case"),
    ({"pattern": r"Score: \d+"}, "has 0 groups; it needs exactly one"),
    ({"pattern": r"(Score"}, "is not a regular expression"),
    ({"score_range": [5, 5]}, r"score_range \[5, 5\] is empty"),
    ({"base_url": "judge-host:8000"}, "base_url must start with http"),
    ({"max_concurrency": 0}, "max_concurrency"),
])
def test_bad_judge_config_is_refused_at_load(src, match):
    with pytest.raises(ConfigError, match=match):
        _load(**src)


def test_literal_braces_and_the_reference_need():
    cfg = _load(template='Reply as JSON {{"score": N}} for: {response}')
    src = cfg.reward.sources["judge"]
    assert src.effective_template.format(question="q", response="r", reference="x") == 'Reply as JSON {"score": N} for: r'
    assert not cfg.reward.needs_reference  # the template shows no reference: rows need no answer
    assert _load().reward.needs_reference  # the default rubric does


def test_the_preset_weighs_the_judge_beside_the_rule_reward():
    cfg = load_config("configs/grpo_judge.yaml")
    judge = cfg.reward.sources["judge"]
    assert [(i.source, i.weight) for i in cfg.reward.recipes["basic_arithmetic"]] == [("answer", 1.0), ("judge", 0.5)]
    assert (judge.base_url, judge.api_key_env, judge.template, judge.on_error) == ("http://localhost:8000/v1", None, None,
                                                                                   "fallback")
    assert cfg.reward.needs_reference  # the default rubric shows the reference answer
    assert check_judge_keys(cfg.reward) == "llm judges: judge (Qwen/Qwen2.5-7B-Instruct at http://localhost:8000/v1)"


# --- the cache key and the config hash ------------------------------------------------------

def _sample(i: int = 0, response: str = "4", **kw) -> RewardSample:
    base = {"sample_id": f"s{i}", "prompt_id": "p0", "label": "a", "question": "What is 2+2?", "prompt_text": "<q>",
            "response": response, "reference": "4"}
    return RewardSample(**{**base, **kw})


def test_cache_key_covers_what_shapes_a_reply_and_nothing_else():
    base = _judge()
    s = _sample()
    # the sample hash, computed here independently: sha256 of the JSON [question, response, reference]
    want = hashlib.sha256(json.dumps(["What is 2+2?", "4", "4"], separators=(",", ":")).encode()).hexdigest()[:32]
    assert sample_hash(s) == want
    assert sample_hash(_sample(7, prompt_text="other", label="b")) == want  # the sample id, label, chat prompt: not shown
    assert sample_hash(_sample(response="5")) != want and sample_hash(_sample(reference="5")) != want
    key = verdict_key(base, template_hash(base), sample_hash(s))
    for same in ({"base_url": "http://elsewhere:1/v1"}, {"max_concurrency": 2}, {"timeout_s": 5}, {"max_retries": 0},
                 {"api_key_env": "JUDGE_KEY"}, {"on_error": "fallback"}, {"normalize": False}, {"pattern": r"S: (\d+)"}):
        c = _judge(**same)
        assert verdict_key(c, template_hash(c), sample_hash(s)) == key, same
    for other in ({"model": "judge-70b"}, {"template": "{response}"}, {"system": "Be strict."}, {"temperature": 0.7},
                  {"top_p": 0.9}, {"max_tokens": 64}, {"seed": 1}, {"seed": None}):
        c = _judge(**other)
        assert verdict_key(c, template_hash(c), sample_hash(s)) != key, other


def test_how_to_reach_the_judge_is_outside_the_stage_config_hash():
    ref = ShardRef(uri="x", stage="rollout", num_rows=1, config_hash="c", manifest_sha256="0" * 64)

    def h(**kw):
        return RewardsInput(rollout=ref, prompts=ref, reward=_load(**kw).reward, out="x").config_hash()

    base = h()
    assert h(base_url="http://moved:9000/v1", max_concurrency=4, timeout_s=5, max_retries=0, api_key_env="K") == base
    assert h(model="other") != base and h(temperature=0.5) != base and h(on_error="fallback") != base



# --- the rewards stage against the server ---------------------------------------------------

RESPONSES = ["4", "four", "2+2 is 4", "5", "It is 4.", "22"]  # lengths 1, 4, 8, 1, 8, 2


def _shards(tmp_path, responses=RESPONSES, labels=("a",)):
    """Prompts (one per label, answer "4") and a rollout with ``responses`` spread over them."""
    n = len(responses)
    prompts = pa.table({"prompt_id": [f"p{j}" for j in range(len(labels))], "data_source": list(labels),
                        "question": ["What is 2+2?"] * len(labels), "prompt_text": ["<q>"] * len(labels),
                        "prompt_token_ids": [[1]] * len(labels), "answer": ["4"] * len(labels),
                        "metadata_json": ["{}"] * len(labels), "images": [[]] * len(labels),
                        "videos": [[]] * len(labels)}, schema=PROMPTS.arrow)
    rollout = pa.table({"sample_id": [f"s{i}" for i in range(n)], "prompt_id": [f"p{i % len(labels)}" for i in range(n)],
                        "sample_index": list(range(n)), "prompt_token_ids": [[1]] * n, "response_token_ids": [[2]] * n,
                        "response_text": list(responses), "rollout_logprobs": [[0.0]] * n, "action_mask": [[True]] * n,
                        "finish_reason": ["stop"] * n, "images": [[]] * n, "videos": [[]] * n,
                        **single_turn_columns(list(responses)), **policy_version_column(n, 0)}, schema=ROLLOUT.arrow)
    return (write_shard(prompts, str(tmp_path / "prompts"), schema=PROMPTS, config_hash="p"),
            write_shard(rollout, str(tmp_path / "rollout"), schema=ROLLOUT, config_hash="r"))


def _reward(srv, recipes=None, **src):
    sources = {"judge": {"type": "llm_judge", "base_url": srv.base_url, "model": "judge-7b", "max_retries": 0, **src},
               "match": {"type": "exact_match"}}
    return load_config(None, {"reward.sources": sources,
                              "reward.recipes": recipes or {"a": [{"source": "judge", "weight": 1.0}]}}).reward


def _run(tmp_path, reward, shards, name="run"):
    p, r = shards
    out = str(tmp_path / name / "iter=000001" / "rewards")
    return stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward, out=out)), out


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    with ChatServer() as srv:
        yield srv


def test_a_verdict_per_sample_in_the_rewards_shard_composed_with_a_rule_reward(tmp_path, server):
    # label a: 0.5 * judge + 1.0 * exact_match; label b: exact_match alone (the judge never sees it)
    recipes = {"a": [{"source": "judge", "weight": 0.5}, {"source": "match", "weight": 1.0}],
               "b": [{"source": "match", "weight": 1.0}]}
    reward = _reward(server, recipes, system="You are a strict grader.", seed=7)
    ref, _ = _run(tmp_path, reward, _shards(tmp_path, labels=("a", "b")))
    rows = read_shard(ref, stage="rewards").to_pylist()
    # samples s0, s2, s4 have label a (responses "4", "2+2 is 4", "It is 4."); the server's score is len % 11
    judged = {0: 1 % 11 / 10, 2: 8 % 11 / 10, 4: 8 % 11 / 10}
    for i, row in enumerate(rows):
        match = 1.0 if i in (0, 2, 4) else 0.0  # exact_match's final answer is 4 in "4", "2+2 is 4", "It is 4."
        assert row["rewards"] == pytest.approx(0.5 * judged[i] + match if i in judged else match, abs=1e-6), i
        if i not in judged:
            assert row["judge_verdicts"] == [] and "judge" not in dict(row["reward_metrics"])
            continue
        (v,) = row["judge_verdicts"]
        assert dict(row["reward_metrics"])["judge"] == pytest.approx(judged[i], abs=1e-6)
        assert (v["source"], v["judge_model"], v["endpoint"], v["served_model"]) == ("judge", "judge-7b", server.base_url,
                                                                                      "judge-7b-served")
        assert v["score"] == pytest.approx(judged[i]) and v["error"] is None and v["finish_reason"] == "stop"
        assert v["system"] == "You are a strict grader."
        assert f"[Response]\n{RESPONSES[i]}\n\n" in v["prompt"] and "[Reference answer]\n4\n" in v["prompt"]
        assert v["reply"] == f"The response has {len(RESPONSES[i])} characters.\nScore: {len(RESPONSES[i]) % 11}"
        assert v["template_hash"] == template_hash(reward.sources["judge"]) and len(v["sample_hash"]) == 32
    # one request per judged sample, with the seed, greedy temperature and the system message
    assert len(server.requests) == 3
    assert {(b["model"], b["seed"], b["temperature"], b["max_tokens"]) for b in server.requests} == {("judge-7b", 7, 0.0, 512)}
    assert all(b["messages"][0] == {"role": "system", "content": "You are a strict grader."} for b in server.requests)
    summary = read_manifest(ref.uri)[0].summary["reward_sources"]["judge"]
    assert (summary["n"], summary["judge_requests"], summary["judge_stored"]) == (3, 3, 0)
    assert summary["mean"] == pytest.approx((0.1 + 0.8 + 0.8) / 3)
    # a source config without a judge writes no verdict column (the optional column stays out)
    no_judge = _reward(server, {"a": [{"source": "match"}], "b": [{"source": "match"}]})
    ref2, _ = _run(tmp_path, no_judge, _shards(tmp_path / "s2", labels=("a", "b")), name="run2")
    assert "judge_verdicts" not in read_shard(ref2, stage="rewards").column_names


def test_an_outage_mid_run_fails_the_stage_naming_the_endpoint_and_the_rerun_resumes(tmp_path, server):
    # one request at a time; the server dies after answering 2 (later requests: dropped connections)
    reward = _reward(server, max_concurrency=1, on_error="fallback")  # an outage is never a fallback
    shards = _shards(tmp_path)
    server.drop_after = 2
    with pytest.raises(SourceUnavailableError) as err:
        _run(tmp_path, reward, shards)
    msg = str(err.value)
    assert f"reward source 'judge' (llm_judge 'judge-7b' at {server.base_url}): unreachable after 0 retries" in msg
    assert "2 of the 6 verdicts asked for were stored" in msg and "a rerun asks only for the other 4" in msg
    assert len(server.requests) == 3  # 2 answered, the third dropped, none started after it
    out = tmp_path / "run" / "iter=000001" / "rewards"
    with pytest.raises(ShardNotCommittedError):
        read_manifest(str(out))
    assert len(list((tmp_path / "run" / VERDICTS_FOLDER).glob("*/*.json"))) == 2
    # the server is back: the rerun asks only for the 4 samples without a verdict
    server.drop_after = None
    before = len(server.requests)
    ref, _ = _run(tmp_path, reward, shards)
    assert len(server.requests) - before == 4
    rows = read_shard(ref, stage="rewards").to_pylist()
    assert [r["rewards"] for r in rows] == pytest.approx([len(x) % 11 / 10 for x in RESPONSES], abs=1e-6)
    s = read_manifest(ref.uri)[0].summary
    assert (s["reward_sources"]["judge"]["judge_requests"], s["reward_sources"]["judge"]["judge_stored"]) == (4, 2)
    assert s["reward_fallbacks"] == 0


def test_a_rerun_with_the_server_stopped_completes_from_the_stored_verdicts(tmp_path, server, monkeypatch):
    reward = _reward(server)
    shards = _shards(tmp_path)

    def killed(table):  # the stage dies after the verdicts, before its commit
        raise RuntimeError("killed before the commit")

    with monkeypatch.context() as m:
        m.setattr(stages.rewards, "rewards_summary", killed)
        with pytest.raises(RuntimeError, match="killed before the commit"):
            _run(tmp_path, reward, shards)
    assert len(server.requests) == 6
    server.stop()  # a request would now be refused
    ref, _ = _run(tmp_path, reward, shards)
    rows = read_shard(ref, stage="rewards").to_pylist()
    assert [r["rewards"] for r in rows] == pytest.approx([len(x) % 11 / 10 for x in RESPONSES], abs=1e-6)
    assert [r["judge_verdicts"][0]["reply"].endswith(f"Score: {len(x) % 11}") for r, x in zip(rows, RESPONSES)] == [True] * 6
    assert read_manifest(ref.uri)[0].summary["reward_sources"]["judge"]["judge_stored"] == 6
    # another iteration of the same run with the same responses asks nothing either (keyed by content)
    p, r = shards
    ref2 = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward,
                                           out=str(tmp_path / "run" / "iter=000002" / "rewards")))
    assert read_shard(ref2, stage="rewards").column("rewards").to_pylist() == [r["rewards"] for r in rows]
    # with the server still stopped, a sample never judged fails naming the endpoint
    p, r = _shards(tmp_path / "new", responses=["6"])
    with pytest.raises(SourceUnavailableError, match=rf"at {server.base_url}\): unreachable after 0 retries"):
        stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward, out=str(tmp_path / "run/iter=000003/rewards")))


def test_an_unparseable_reply_raises_naming_the_sample_or_falls_back_from_the_stored_reply(tmp_path, server):
    server.reply = lambda messages: "I cannot tell." if response_of(messages) == "22" else "Score: 10"
    shards = _shards(tmp_path)
    with pytest.raises(RewardError, match=r"reward source 'judge' on sample s5: no score in the reply .*reply of "
                                          r"'judge-7b' at http://127.0.0.1:\d+/v1 \(finish_reason stop\) ends 'I cannot tell.'"):
        _run(tmp_path, _reward(server), shards)
    assert len(server.requests) == 6
    # on_error: fallback; the replies are stored, so the rerun with the other policy asks nothing
    ref, _ = _run(tmp_path, _reward(server, on_error="fallback", fallback=-1.0), shards)
    assert len(server.requests) == 6
    rows = read_shard(ref, stage="rewards").to_pylist()
    assert [r["rewards"] for r in rows] == [1.0] * 5 + [-1.0]
    assert dict(rows[5]["reward_metrics"]) == {"judge": -1.0, "judge.fallback": 1.0}
    assert dict(rows[5]["reward_reasons"])["judge"].startswith("fallback -1: no score in the reply")
    assert (rows[5]["judge_verdicts"][0]["reply"], rows[5]["judge_verdicts"][0]["score"]) == ("I cannot tell.", None)
    assert read_manifest(ref.uri)[0].summary["reward_fallbacks"] == 1


def test_a_request_refused_for_one_sample_is_that_samples_error_and_is_not_stored(tmp_path, server):
    server.status_for = lambda messages: 400 if response_of(messages) == "2+2 is 4" else None
    reward = _reward(server, on_error="fallback")
    ref, _ = _run(tmp_path, reward, _shards(tmp_path))
    rows = read_shard(ref, stage="rewards").to_pylist()
    assert dict(rows[2]["reward_metrics"]) == {"judge": 0.0, "judge.fallback": 1.0}
    v = rows[2]["judge_verdicts"][0]
    assert (v["reply"], v["score"]) == ("", None) and v["error"].startswith("HTTP 400: ")
    assert "maximum context length exceeded" in dict(rows[2]["reward_reasons"])["judge"]
    # the next iteration of the run with the same responses asks again only for the refused one
    before = len(server.requests)
    p, r = _shards(tmp_path / "next")
    stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=reward, out=str(tmp_path / "run" / "iter=000002" / "rewards")))
    assert len(server.requests) - before == 1


def test_concurrency_is_bounded_and_the_clients_retries_carry_a_flaky_server(server):
    server.delay_s = 0.15
    samples = [_sample(i, response="x" * i) for i in range(12)]
    src = LLMJudgeReward(_judge(base_url=server.base_url, max_concurrency=3, max_retries=0), "judge")
    t0 = time.perf_counter()
    scores = src.score(samples)
    assert [s.score for s in scores] == pytest.approx([i % 11 / 10 for i in range(12)])
    assert server.max_active == 3  # 12 requests of 0.15 s, 3 at a time
    assert time.perf_counter() - t0 >= 4 * 0.15
    # samples that show the judge the same question, response and reference: one request for both
    server.delay_s, server.requests[:] = 0.0, []
    twins = src.score([_sample(20, response="same"), _sample(21, response="same")])
    assert len(server.requests) == 1 and [t.score for t in twins] == [0.4, 0.4] and twins[0].record == twins[1].record
    # a 503, then the client's own retry (max_retries=1, after about 0.5 s) gets through
    server.delay_s, server.max_active, server.requests[:] = 0.0, 0, []
    server.fail_first = 1
    src = LLMJudgeReward(_judge(base_url=server.base_url, max_concurrency=1, max_retries=1), "judge")
    assert [s.score for s in src.score(samples[:3])] == pytest.approx([0.0, 0.1, 0.2])
    assert len(server.requests) == 4  # 3 samples + 1 retry of the first
    # without retries the 503 stops the source, naming the endpoint and the status
    server.requests[:] = []
    src = LLMJudgeReward(_judge(base_url=server.base_url, max_concurrency=1, max_retries=0), "judge")
    with pytest.raises(SourceUnavailableError, match=rf"at {server.base_url}\): HTTP 503 \(after 0 retries\): overloaded"):
        src.score(samples[:3])


def test_the_api_key_comes_from_the_named_variable_and_a_missing_one_is_named_before_any_request(server, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY")
    src = LLMJudgeReward(_judge(base_url=server.base_url), "judge")
    with pytest.raises(SourceUnavailableError, match=r"reward source 'judge' \(llm_judge 'judge-7b' at http://127.0.0.1:\d+/v1\): "
                                                     r"the environment variable OPENAI_API_KEY holds no API key"):
        src.score([_sample()])
    assert server.requests == []
    reward = _load(api_key_env="JUDGE_KEY").reward
    with pytest.raises(SourceUnavailableError, match="JUDGE_KEY holds no API key"):
        check_judge_keys(reward)
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    assert check_judge_keys(reward) == f"llm judges: judge (m at {URL})"
    src = LLMJudgeReward(_judge(base_url=server.base_url, api_key_env="JUDGE_KEY", on_error="fallback"), "judge")
    with pytest.raises(SourceUnavailableError, match=r"HTTP 401 \(not retried\): the API key was refused"):
        src.score([_sample()])
    monkeypatch.setenv("JUDGE_KEY", "test-key")
    assert src.score([_sample()])[0].score == pytest.approx(0.1)
    # api_key_env: null sends vLLM's placeholder
    server.key = "EMPTY"
    assert LLMJudgeReward(_judge(base_url=server.base_url, api_key_env=None), "judge").score([_sample()])[0].score == 0.1
