"""Held-out split (disjoint question texts), greedy generation against a reference loop, the
eval summary by hand, and checkpoint resolution."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from rft_core.data.prompts import HELDOUT_SEED_OFFSET, DatasetError, build_prompts, heldout_entries, heldout_seed, load_task
from rft_core.stages.evaluate import default_eval_root, eval_summary, greedy_generate, resolve_checkpoint
from schemas import ShardError, ShardRef, commit_files, write_shard
from schemas.columns import EVAL, POLICY_CHECKPOINT, PPO_UPDATE, PROMPTS

EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "allow_parentheses": False,
        "allow_negation": False}


def _questions(task, size, seed, cfg):
    ds = load_task(task, size=size, seed=seed, task_config=cfg)
    return [ds[i]["question"] for i in range(size)]


def test_heldout_questions_disjoint_from_training_and_distinct():
    train = set(_questions("basic_arithmetic", 2000, 1234, EASY))
    seed = heldout_seed(train_seed=1234, train_size=2000)
    assert seed == 1234 + 2000 + HELDOUT_SEED_OFFSET
    entries = heldout_entries("basic_arithmetic", num_prompts=150, train_size=2000, train_seed=1234, seed=seed,
                              task_config=EASY)
    qs = [e["question"] for _, e in entries]
    assert len(qs) == 150 and len(set(qs)) == 150
    assert not set(qs) & train
    idx = [i for i, _ in entries]
    assert idx == sorted(idx) and len(set(idx)) == 150
    # the same arguments give the same split
    again = heldout_entries("basic_arithmetic", num_prompts=150, train_size=2000, train_seed=1234, seed=seed,
                            task_config=EASY)
    assert [e["question"] for _, e in again] == qs


def test_heldout_filter_does_the_work_when_seeds_share_streams():
    # reasoning-gym builds entry idx from Random(seed + idx): seed + 1 is the training set shifted
    # by one, so without the text filter the "held-out" questions would be training questions.
    train = _questions("basic_arithmetic", 200, 1234, EASY)
    shifted = _questions("basic_arithmetic", 100, 1235, EASY)
    assert shifted[:99] == train[1:100]
    entries = heldout_entries("basic_arithmetic", num_prompts=60, train_size=200, train_seed=1234, seed=1235,
                              task_config=EASY)
    assert all(i >= 199 for i, _ in entries)  # entries 0..198 of seed 1235 are training entries 1..199
    assert not {e["question"] for _, e in entries} & set(train)


def test_heldout_too_few_distinct_questions_is_an_error():
    tiny_space = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": "+",
                  "allow_parentheses": False, "allow_negation": False}  # a + b, a, b in 0..10: 121 questions
    with pytest.raises(DatasetError, match=r"only \d+ of 104 candidates.*asked for 10"):
        heldout_entries("basic_arithmetic", num_prompts=10, train_size=2000, train_seed=0, seed=10_000,
                        task_config=tiny_space)
    with pytest.raises(ValueError, match="num_prompts"):
        heldout_entries("basic_arithmetic", num_prompts=0, train_size=10, train_seed=0, seed=1)


def test_build_prompts_id_prefix():
    tok = type("Tok", (), {"apply_chat_template": lambda self, m, **kw: m[-1]["content"],
                           "__call__": lambda self, text, **kw: {"input_ids": [1, 2, 3]}})()
    entries = [(7, {"question": "Calculate 1 + 2.", "answer": "3"})]
    t = build_prompts(entries, tok, data_source="basic_arithmetic", system_prompt="", max_prompt_tokens=8,
                      id_prefix="heldout-basic_arithmetic").table
    assert t.column("prompt_id").to_pylist() == ["heldout-basic_arithmetic-000007"]
    assert t.column("data_source").to_pylist() == ["basic_arithmetic"]  # the grader's key is unchanged
    t = build_prompts(entries, tok, data_source="basic_arithmetic", system_prompt="", max_prompt_tokens=8).table
    assert t.column("prompt_id").to_pylist() == ["basic_arithmetic-000007"]


def _reference_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding without cache or padding: full forward pass per step."""
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        t = int(logits.argmax())
        lps.append(float(logits.log_softmax(-1)[t]))
        out.append(t)
        ids.append(t)
    return out, lps


@torch.no_grad()
def test_greedy_generate_matches_reference_loop_and_stops_at_eos(tiny_model):
    from rft_core.models.loading import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    model.eval()
    model.generation_config.eos_token_id = None
    prompts = [[1, 520, 33, 901, 17], [44, 45], [300, 301, 302]]
    ref = [_reference_greedy(model, p, 6) for p in prompts]
    never = next(t for t in range(10, 1000) if all(t not in r[0] for r in ref))
    fake_tok = SimpleNamespace(eos_token_id=never, pad_token_id=tok.pad_token_id)
    gens = greedy_generate(model, fake_tok, prompts, max_new_tokens=6, batch_size=2)  # 2 micro-batches, left padding
    assert [g.prompt_index for g in gens] == [0, 1, 2] and {g.sample_index for g in gens} == {0}
    for g, (toks, lps) in zip(gens, ref):
        assert g.response_token_ids == toks and g.finish_reason == "length"
        assert g.logprobs == pytest.approx(lps, abs=1e-4)
    # a token that prompt 1's greedy response contains as EOS: every response ends at its first
    # occurrence (EOS kept, finish "stop"), the others run to max_new_tokens
    eos = ref[1][0][-1]
    gens = greedy_generate(model, SimpleNamespace(eos_token_id=eos, pad_token_id=tok.pad_token_id), prompts,
                           max_new_tokens=6, batch_size=3)
    for g, (toks, lps) in zip(gens, ref):
        cut = toks.index(eos) + 1 if eos in toks else len(toks)
        assert g.response_token_ids == toks[:cut] and len(g.logprobs) == cut
        assert g.finish_reason == ("stop" if eos in toks else "length")
    assert gens[1].finish_reason == "stop"
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(model, fake_tok, prompts, max_new_tokens=0, batch_size=2)


def test_eval_summary_by_hand():
    table = pa.table({"sample_id": list("abcd"), "prompt_id": list("abcd"), "question": ["q"] * 4, "answer": ["1"] * 4,
                      "response_text": ["r"] * 4, "extracted_answer": ["1", None, "2", "1"],
                      "rewards": [1.1, 0.1, 0.0, 1.0], "correct": [True, False, False, True],
                      "response_length": [3, 5, 8, 4], "finish_reason": ["stop", "stop", "length", "stop"]},
                     schema=EVAL.arrow)
    s = eval_summary(table)
    assert s["num_prompts"] == 4 and s["accuracy"] == 0.5
    assert s["accuracy_stderr"] == pytest.approx(math.sqrt(0.25 / 4))
    assert s["reward_mean"] == pytest.approx(0.55)
    # deviations .55 -.45 -.55 .45: squares sum 1.01, / (n-1) = .336667, / n, sqrt
    assert s["reward_stderr"] == pytest.approx(math.sqrt(1.01 / 3 / 4), rel=1e-6)
    assert s["response_length_mean"] == 5.0 and s["truncated_fraction"] == 0.25
    with pytest.raises(ValueError, match="no rows"):
        eval_summary(table.slice(0, 0))


def _commit_update(uri: str) -> ShardRef:
    row = {f.name: [0] for f in PPO_UPDATE.schema}
    return write_shard(pa.table(row, schema=PPO_UPDATE.arrow), uri, schema=PPO_UPDATE, config_hash="c0ffee")


def test_resolve_checkpoint(tmp_path):
    run = tmp_path / "run"
    first = _commit_update(f"{run}/iter=000001/ppo_update")
    second = _commit_update(f"{run}/iter=000002/ppo_update")
    (run / "iter=000003/rollout").mkdir(parents=True)  # started, not committed
    (run / "iter=000002/ppo_update/policy").mkdir()
    assert resolve_checkpoint("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert resolve_checkpoint(first) is first
    assert resolve_checkpoint(f"{run}/iter=000001/ppo_update") == first
    assert resolve_checkpoint(f"{run}/iter=000002/ppo_update/policy/") == second
    assert resolve_checkpoint(str(run)) == second  # the last committed iteration
    hf_folder = tmp_path / "hf"
    hf_folder.mkdir()
    assert resolve_checkpoint(str(hf_folder)) == str(hf_folder)
    write_shard(pa.table({f.name: [] for f in PROMPTS.schema}, schema=PROMPTS.arrow), f"{run}/iter=000001/prompts",
                schema=PROMPTS, config_hash="x")
    with pytest.raises(ShardError, match="committed 'prompts' stage"):
        resolve_checkpoint(f"{run}/iter=000001/prompts")
    (tmp_path / "empty/iter=000001/rollout").mkdir(parents=True)
    with pytest.raises(ShardError, match="without a committed ppo_update"):
        resolve_checkpoint(str(tmp_path / "empty"))


def test_resolve_checkpoint_of_weights_written_in_the_background(tmp_path):
    """``iter=N/ppo_update-policy`` (or its ``policy/``), what ``TrainResult.final_policy_folder``
    names for weights written in the background: the update whose weights it holds; a
    ``-policy`` stage written for another update than the one committed beside it is refused."""
    run = tmp_path / "run"
    update = _commit_update(f"{run}/iter=000001/ppo_update")
    (run / "iter=000001/ppo_update-policy/policy").mkdir(parents=True)
    (run / "iter=000002/ppo_update-policy").mkdir(parents=True)
    commit_files(f"{update.uri}-policy", stage=POLICY_CHECKPOINT.stage, config_hash="w", inputs={"ppo_update": update},
                 schema=POLICY_CHECKPOINT)
    assert resolve_checkpoint(f"{run}/iter=000001/ppo_update-policy/policy/") == update
    assert resolve_checkpoint(f"{run}/iter=000001/ppo_update-policy") == update
    other = _commit_update(f"{run}/iter=000002/ppo_update")
    commit_files(f"{run}/iter=000002/ppo_update-policy", stage=POLICY_CHECKPOINT.stage, config_hash="w",
                 inputs={"ppo_update": update}, schema=POLICY_CHECKPOINT)
    with pytest.raises(ShardError, match=f"written for another {other.uri}"):
        resolve_checkpoint(f"{run}/iter=000002/ppo_update-policy")


def test_default_eval_root(tmp_path):
    ref = ShardRef(uri=f"{tmp_path}/run/iter=000012/ppo_update", stage="ppo_update", num_rows=1, config_hash="c",
                   manifest_sha256="m")
    assert default_eval_root(ref, fingerprint="abc") == f"{tmp_path}/run/eval/iter=000012-abc"
    assert default_eval_root("smollm2-135m-instruct", fingerprint="abc", base=str(tmp_path / "ev")) == \
        f"{tmp_path}/ev/smollm2-135m-instruct-abc"
    assert default_eval_root("/models/my model/", fingerprint="f", base="memory://ev") == "memory://ev/my-model-f"


def _sampled_table(rows: list[tuple[str, str, int, bool, str | None, float]]) -> pa.Table:
    """An `eval` table with the sampled columns from (prompt_id, data_source, sample_index,
    correct, extracted_answer, reward) tuples."""
    cols = {f.name: [] for f in EVAL.arrow_with(["data_source", "sample_index"])}
    for pid, src, k, ok, extracted, reward in rows:
        for key, v in (("sample_id", f"{pid}#{k}"), ("prompt_id", pid), ("question", "q"), ("answer", "1"),
                       ("response_text", "r"), ("extracted_answer", extracted), ("rewards", reward), ("correct", ok),
                       ("response_length", 4 + k), ("finish_reason", "length" if k == 0 else "stop"),
                       ("data_source", src), ("sample_index", k)):
            cols[key].append(v)
    return pa.table(cols, schema=EVAL.arrow_with(["data_source", "sample_index"]))


def test_sampled_eval_summary_by_hand():
    from rft_core.stages.evaluate import sampled_eval_summary

    table = _sampled_table([
        ("p0", "gsm8k", 0, True, "1", 1.0), ("p0", "gsm8k", 1, False, "2", 0.0),
        ("p1", "gsm8k", 1, False, "3", 0.1), ("p1", "gsm8k", 0, False, "3", 0.0),   # out of order: sorted by index
        ("p2", "aime", 0, True, "1", 1.1), ("p2", "aime", 1, True, "1.0", 1.0),
    ])
    s = sampled_eval_summary(table, n_samples=2)
    assert (s["num_prompts"], s["num_samples"], s["n_samples"]) == (3, 6, 2)
    acc = [0.5, 0.0, 1.0]  # per prompt
    assert s["accuracy"] == pytest.approx(0.5) and s["metrics"]["overall"]["avg@2"] == pytest.approx(0.5)
    se = math.sqrt(sum((a - 0.5) ** 2 for a in acc) / 2 / 3)  # sd (ddof 1) / sqrt(prompts), not binomial over rows
    assert s["accuracy_stderr"] == pytest.approx(se) and s["metrics"]["overall"]["avg@2_stderr"] == pytest.approx(se)
    assert s["reward_mean"] == pytest.approx(3.2 / 6)
    means = [0.5, 0.05, 1.05]
    m = sum(means) / 3
    assert s["reward_stderr"] == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in means) / 2 / 3))
    overall = s["metrics"]["overall"]
    assert overall["pass@1"] == pytest.approx(0.5) and overall["pass@2"] == pytest.approx(2 / 3)
    assert overall["maj@2"] == pytest.approx((0.5 + 0 + 1) / 3)  # p0: a tie of "correct" and "2"
    assert s["metrics"]["by_data_source"]["aime"]["avg@2"] == 1.0 and s["metrics"]["by_data_source"]["aime"]["avg@2_stderr"] is None
    assert s["metrics"]["by_data_source"]["gsm8k"]["pass@2"] == pytest.approx(0.5)
    assert s["response_length_mean"] == pytest.approx(4.5) and s["truncated_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"prompt 'p2' has responses \[0\], expected sample indices 0..1"):
        sampled_eval_summary(table.slice(0, 5), n_samples=2)


def test_eval_report_lines_and_markdown():
    from rft_core.stages.evaluate import eval_markdown, eval_report_lines, sampled_eval_summary

    table = _sampled_table([(f"p{i}", "gsm8k" if i < 2 else "aime", k, (i + k) % 3 == 0, str((i + k) % 3), 0.0)
                            for i in range(3) for k in range(3)])
    s = {**sampled_eval_summary(table, n_samples=3), "temperature": 0.7, "top_p": 0.95, "seed": 0, "policy": "m"}
    lines = eval_report_lines(s)
    o = s["metrics"]["overall"]
    for name in ("avg@3", "pass@1", "pass@2", "pass@3", "maj@3"):
        line = next(x for x in lines if x.startswith(f"{name}:"))
        assert line.split(":", 1)[1].split() == [f"{o[name]:.3f}", "±", f"{o[name + '_stderr']:.3f}"]
    assert "by data_source:" in lines and any(x.startswith("  aime (1 prompts): avg@3") and "± n/a" in x for x in lines)
    assert lines[0].startswith("decoding:    sampled, 3 answers per prompt (temperature 0.7, top-p 0.95, seed 0)")
    md = eval_markdown(table, s)
    assert "| data_source | prompts | avg@3 | pass@1 | pass@2 | pass@3 | maj@3 |" in md
    assert f"| overall | 3 | {o['avg@3']:.3f} ± {o['avg@3_stderr']:.3f} |" in md
    assert eval_report_lines({"accuracy": 0.5}) == []  # greedy: the CLI prints its accuracy line as before


def test_eval_config_decoding_and_sampling_rules():
    from rft_core.config import ConfigError, EvalConfig, load_config

    assert not EvalConfig().sampled and EvalConfig().decoding(0.7, 0.9) == (None, 1.0)  # greedy, as before
    assert EvalConfig(n_samples=8).decoding(0.7, 0.9) == (0.7, 0.9)  # the rollout's sampling
    assert EvalConfig(n_samples=8, temperature=0.6, top_p=0.95).decoding(0.7, 0.9) == (0.6, 0.95)
    assert EvalConfig(temperature=0.6).sampled and EvalConfig(temperature=0.6).decoding(1.0, 1.0) == (0.6, 1.0)
    assert not EvalConfig(temperature=0).sampled
    load_config(None, {"eval.n_samples": 8, "eval.top_p": 0.95})  # the valid neighbours of rule eval-sampling
    with pytest.raises(ConfigError, match="eval.temperature=0"):
        load_config(None, {"eval.n_samples": 8, "eval.temperature": 0})
    with pytest.raises(ConfigError, match="eval.top_p=0.95 is set but decoding is greedy"):
        load_config(None, {"eval.top_p": 0.95})


def test_eval_stage_inputs_greedy_defaults_keep_their_hash():
    from rft_core.stages.contracts import EvalGenerateInput, EvalSummaryInput

    ref = ShardRef(uri="memory://p", stage="prompts", num_rows=1, config_hash="c", manifest_sha256="m")
    greedy = EvalGenerateInput(prompts=ref, policy="m", max_new_tokens=4, batch_size=2, out="memory://o")
    assert set(greedy.hash_view()) == {"prompts", "policy", "max_new_tokens", "batch_size"}  # the fields it had before
    sampled = EvalGenerateInput(prompts=ref, policy="m", max_new_tokens=4, batch_size=2, out="memory://o", n_samples=4,
                                temperature=1.0)
    assert sampled.config_hash() != greedy.config_hash() and greedy.contract == "eval_generate v5"
    with pytest.raises(ValueError, match="need a sampling temperature"):
        EvalGenerateInput(prompts=ref, policy="m", max_new_tokens=4, batch_size=2, out="o", n_samples=4)
    s = EvalSummaryInput(prompts=ref, rollout=ref, rewards=ref, policy="m", out="o")
    assert set(s.hash_view()) == {"prompts", "rollout", "rewards", "policy"} and s.contract == "eval_summary v1"
    with pytest.raises(ValueError, match="greedy decoding gives one response"):
        EvalSummaryInput(prompts=ref, rollout=ref, rewards=ref, policy="m", out="o", n_samples=4)


@torch.no_grad()
def test_sample_generate_groups_seeds_and_near_zero_temperature_is_greedy(tiny_model):
    from rft_core.models.loading import load_causal_lm, load_tokenizer
    from rft_core.stages.evaluate import sample_generate

    model, tok = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    model.eval()
    prompts = [[1, 520, 33, 901, 17], [44, 45], [300, 301, 302]]
    kw = {"n_samples": 4, "top_p": 1.0, "max_new_tokens": 6, "batch_size": 8}
    gens = sample_generate(model, tok, prompts, temperature=1.0, seed=3, **kw)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, k) for p in range(3) for k in range(4)]
    texts = [tuple(g.response_token_ids) for g in gens]
    assert len(set(texts[:4])) > 1  # a random tiny model at temperature 1: the 4 answers of a prompt differ
    assert [tuple(g.response_token_ids) for g in sample_generate(model, tok, prompts, temperature=1.0, seed=3, **kw)] == texts
    assert [tuple(g.response_token_ids) for g in sample_generate(model, tok, prompts, temperature=1.0, seed=4, **kw)] != texts
    cold = sample_generate(model, tok, prompts, temperature=1e-4, seed=3, **kw)
    greedy = greedy_generate(model, tok, prompts, max_new_tokens=6, batch_size=8)
    assert all(c.response_token_ids == greedy[c.prompt_index].response_token_ids for c in cold)
    with pytest.raises(ValueError, match="temperature > 0"):
        sample_generate(model, tok, prompts, temperature=0.0, seed=0, **kw)
