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
from schemas import ShardError, ShardRef, write_shard
from schemas.columns import EVAL, PPO_UPDATE, PROMPTS

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


def test_default_eval_root(tmp_path):
    ref = ShardRef(uri=f"{tmp_path}/run/iter=000012/ppo_update", stage="ppo_update", num_rows=1, config_hash="c",
                   manifest_sha256="m")
    assert default_eval_root(ref, fingerprint="abc") == f"{tmp_path}/run/eval/iter=000012-abc"
    assert default_eval_root("smollm2-135m-instruct", fingerprint="abc", base=str(tmp_path / "ev")) == \
        f"{tmp_path}/ev/smollm2-135m-instruct-abc"
    assert default_eval_root("/models/my model/", fingerprint="f", base="memory://ev") == "memory://ev/my-model-f"
