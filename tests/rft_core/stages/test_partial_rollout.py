"""Partial rollouts (``rollout.partial``, issue 48; ``rft_core.stages.partial``) at the stage
level, on the tiny model (which never emits EOS within these budgets, so every sequence runs to
``max_new_tokens``): each rollout gives every unfinished sequence one chunk; the unfinished groups
are committed whole in the rollout shard's carry and continued by the next rollout from their
tokens under the next policy; each token keeps the version and the log-prob of the policy that
sampled it; a group enters the shard's rows when its last sample finishes; a recomputed rollout
is bit-identical (a resume of a run killed mid-chunk continues the same sequences). Samples that
stop at an EOS inside a carried group are given to ``continue_carried`` by a scripted engine."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from rft_core.engines.continuation import continue_sequences
from rft_core.engines.hf import HFEngine
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.stages import prompts as prompts_stage
from rft_core.stages import rollout as rollout_stage
from rft_core.stages.contracts import PromptsInput, RolloutInput
from rft_core.stages.partial import (
    CARRY_ROLLOUT,
    CONTINUE_OFFSET,
    UNFINISHED,
    Sequence,
    partial_summary,
    read_carry,
    split_groups,
)
from schemas import ShardCorruptError, read_manifest, read_shard
from schemas.columns import token_versions_of
from tests.flows.conftest import flow_cfg
from tests.tiny import build_tiny_model

CHUNK, MAX_NEW = 5, 12  # chunks of 5, 5 and 2 tokens: the last one's budget is what is left


@pytest.fixture(scope="module")
def chain(tiny_model, tmp_path_factory):
    """Three partial rollouts (2 prompts x 2 samples each) chained by their carries; version 0 is
    the tiny model, versions 1 and 2 another random model (seed 1), so a chunk's policy shows in
    its log-probs."""
    root = tmp_path_factory.mktemp("partial")
    other = build_tiny_model(root / "other", seed=1)
    cfg = flow_cfg(tiny_model, root / "run", **{"data.prompts_per_iteration": 2, "rollout.n_samples_per_prompt": 2,
                                                "rollout.batch_size": 4, "rollout.max_new_tokens": MAX_NEW,
                                                "rollout.max_staleness": 1, "rollout.partial.chunk_tokens": CHUNK})
    refs, inputs, carry = [], [], None
    for it, (policy, version) in enumerate([(tiny_model, 0), (other, 1), (other, 2)], start=1):
        prompts = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=it, carry=carry,
                                                 out=str(root / f"prompts{it}")))
        inp = RolloutInput(prompts=prompts, policy=policy, policy_version=version, rollout=cfg.rollout, iteration=it,
                           carry=carry, out=str(root / f"rollout{it}"))
        carry = rollout_stage.run(inp)
        refs.append(carry)
        inputs.append(inp)
    return root, other, refs, inputs


def test_unfinished_groups_are_carried_whole_and_continued_from_their_tokens(chain, tiny_model):
    root, other, refs, inputs = chain
    r1, r2, r3 = refs
    assert (r1.num_rows, r2.num_rows) == (0, 0)  # no group finished in its first two chunks
    c1, p1 = read_carry(r1)
    c2, _ = read_carry(r2)
    assert c1.num_rows == 4 and set(c1.column("finish_reason").to_pylist()) == {UNFINISHED}
    groups1 = sorted(set(c1.column("prompt_id").to_pylist()))
    assert all(g.endswith("@1") for g in groups1) and sorted(p1.column("prompt_id").to_pylist()) == groups1
    assert token_versions_of(c1) == [[0] * CHUNK] * 4
    # the prompts of iteration 2: its own two, then the two carried groups' rows
    prompts2 = read_shard(inputs[1].prompts, stage="prompts").column("prompt_id").to_pylist()
    assert prompts2[2:] == p1.column("prompt_id").to_pylist() and not any("@" in p for p in prompts2[:2])
    # iteration 2 continued iteration 1's sequences: their first chunk as it was, then 5 tokens of version 1
    old = {r["sample_id"]: r for r in c1.to_pylist()}
    new = {r["sample_id"]: r for r in c2.to_pylist() if r["sample_id"] in old}
    assert len(new) == 4
    for sid, row in new.items():
        assert row["response_token_ids"][:CHUNK] == old[sid]["response_token_ids"]
        assert row["rollout_logprobs"][:CHUNK] == old[sid]["rollout_logprobs"]
        assert row["token_versions"] == [0] * CHUNK + [1] * CHUNK and row["policy_version"] == 1
    # ... exactly as the seeding rule says: one continue_sequences of the carry's rows in order
    tok = load_tokenizer(tiny_model)
    v1 = load_causal_lm(other)
    rows = c1.to_pylist()
    want = continue_sequences(HFEngine(v1, tok), [r["prompt_token_ids"] + r["response_token_ids"] for r in rows],
                              [CHUNK] * 4, temperature=1.0, top_p=1.0, batch_size=4,
                              seed=rollout_stage.rollout_seed(inputs[1]) + CONTINUE_OFFSET)
    for r, g in zip(rows, want):
        assert new[r["sample_id"]]["response_token_ids"][CHUNK:] == g.response_token_ids
        assert new[r["sample_id"]]["rollout_logprobs"][CHUNK:] == g.logprobs


def test_every_token_keeps_the_log_prob_of_the_policy_that_sampled_it(chain, tiny_model):
    root, other, refs, _ = chain
    rows = read_shard(refs[2], stage="rollout").to_pylist()
    assert len(rows) == 4 and {r["prompt_id"].rsplit("@", 1)[1] for r in rows} == {"1"}  # iteration 1's groups finished
    tok = load_tokenizer(tiny_model)
    prompts, responses = [r["prompt_token_ids"] for r in rows], [r["response_token_ids"] for r in rows]
    by_version = {v: batched_response_logprobs(load_causal_lm(path), prompts, responses, pad_token_id=tok.pad_token_id)
                  for v, path in ((0, tiny_model), (1, other))}
    for i, r in enumerate(rows):
        assert len(r["response_token_ids"]) == MAX_NEW and r["finish_reason"] == "length"
        assert r["token_versions"] == [0] * CHUNK + [1] * CHUNK + [2] * (MAX_NEW - 2 * CHUNK) and r["policy_version"] == 2
        # versions 1 and 2 are the same weights (other); version 0 the tiny model's: each span scores under its own
        for j, v in enumerate(r["token_versions"]):
            assert r["rollout_logprobs"][j] == pytest.approx(float(by_version[min(v, 1)][i][j]), abs=2e-4)
        assert abs(r["rollout_logprobs"][0] - float(by_version[1][i][0])) > 1e-2  # the other model would differ
    summary = read_manifest(refs[2].uri)[0].summary
    assert summary["partial_finished_groups"] == 2 and summary["partial_carried_groups"] == 4
    # this rollout's own tokens: 2 to finish iteration 1's 4 sequences, 5 more for iteration 2's, 5 for its own 4
    assert summary["generated_tokens"] == 4 * 2 + 4 * 5 + 4 * 5 and summary["partial_continued_sequences"] == 8
    assert summary["multi_version_frac"] == 1.0 and summary["version_span_tokens_mean"] == pytest.approx(12 / 3)
    # iteration 3's update starts from version 2: staleness 2, 1 and 0 for the three spans
    assert summary["tokens_by_staleness"] == {"0": 4 * 2, "1": 4 * 5, "2": 4 * 5}


def test_a_recomputed_partial_rollout_is_bit_identical(chain):
    """What a resume after a kill mid-chunk does: the rollout stage runs again from the same
    committed inputs (prompts, carry, policy) and writes the same parts and carry, byte for byte."""
    root, _, refs, inputs = chain
    again = rollout_stage.run(inputs[1].model_copy(update={"out": str(root / "rollout2-again")}))
    files = [{e.path: e.checksum for e in read_manifest(ref.uri)[0].files} for ref in (refs[1], again)]
    assert files[0] == files[1] and CARRY_ROLLOUT in files[0]
    assert read_carry(refs[1])[0].num_rows == 8  # 4 continued + 4 started: not an empty thing compared


def test_a_damaged_carry_is_refused_by_name(chain, tmp_path):
    import shutil

    root, _, refs, _ = chain
    copy = tmp_path / "rollout"
    shutil.copytree(refs[1].uri, copy)
    path = copy / CARRY_ROLLOUT
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="carry/rollout.parquet"):
        read_carry(str(copy))


def _seq(group: str, k: int, n: int, finish: str, versions: list[int]) -> Sequence:
    return Sequence(group, k, [1, 2], list(range(n)), [-1.0] * n, versions, finish)


def test_a_group_enters_training_when_its_last_sample_finishes():
    seqs = [_seq("a", 0, 3, "stop", [4, 4, 4]), _seq("a", 1, 6, UNFINISHED, [4] * 6),  # a: one sample still running
            _seq("b@2", 0, 8, "length", [1, 1, 2, 2, 3, 3, 4, 4]), _seq("b@2", 1, 2, "stop", [1, 1]),  # b: both done
            _seq("c@3", 0, 4, UNFINISHED, [2, 2, 3, 3]), _seq("c@3", 1, 4, UNFINISHED, [2, 2, 3, 3])]
    done, waiting = split_groups(seqs, iteration=4)
    assert [(s.group, s.sample_index) for s in done] == [("b@2", 0), ("b@2", 1)]
    # a finished sample waits for its group; a group carried for the first time is renamed after this iteration
    assert [(s.group, s.sample_index, s.finish) for s in waiting] == [
        ("a@4", 0, "stop"), ("a@4", 1, UNFINISHED), ("c@3", 0, UNFINISHED), ("c@3", 1, UNFINISHED)]
    summary = partial_summary(done, waiting, iteration=4, continued=2)
    assert summary == {
        "partial_finished_groups": 1, "partial_carried_groups": 2, "partial_carried_sequences": 3,
        "partial_continued_sequences": 2, "multi_version_frac": 0.5,
        "version_span_tokens_mean": 10 / 5,  # runs 2, 2, 2, 2 (b@2#0) and 2 (b@2#1)
        "token_staleness_mean": (2 * 2 + 2 * 1 + 2 * 0 + 2 * -1 + 2 * 2) / 10,  # (4 - 1) - version
        "token_staleness_max": 2, "tokens_by_staleness": {"-1": 2, "0": 2, "1": 2, "2": 4}}


class _ScriptedEngine:
    """The engines' ``generate`` contract (``rft_core.engines.hf.HFEngine``), scripted: prefix i
    of a call answers the tokens ``script[first token after the prompt]`` up to and including the
    first EOS (``EOS``), "stop", or cut at the call's budget, "length"; every call is recorded
    (prefixes, budget, seed)."""

    EOS = 0

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.script, self.calls = script, []

    def generate(self, prompts, *, n_samples_per_prompt, max_new_tokens, seed, **_):
        from rft_core.engines.hf import Generation

        assert n_samples_per_prompt == 1
        self.calls.append(([list(p) for p in prompts], max_new_tokens, seed))
        out = []
        for i, prefix in enumerate(prompts):
            tokens = self.script[prefix[2]][:max_new_tokens]  # prefix: the 2 prompt tokens, then the response
            stop = self.EOS in tokens
            tokens = tokens[:tokens.index(self.EOS) + 1] if stop else tokens
            out.append(Generation(i, 0, tokens, [-0.5 - 0.1 * t for t in tokens], "stop" if stop else "length"))
        return out


def test_only_unfinished_samples_of_a_carried_group_are_continued_and_an_early_stop_is_kept():
    """``continue_carried`` on carried groups whose samples stopped at an EOS in an earlier chunk
    or still run: only the running ones are given a chunk (budget min(chunk, max_new - tokens so
    far); one call per budget, in increasing order, seeded ``seed + CONTINUE_OFFSET +
    BUDGET_STRIDE * budget``), a stopped sample keeps its tokens, versions and "stop"; a sample
    that stops inside this chunk ends "stop" with its tokens up to the EOS; one that reaches
    ``max_new_tokens`` ends "length", one below it runs on. Then the groups whose samples have all
    finished enter training and the other is carried again, whole."""
    from types import SimpleNamespace

    from rft_core.engines.continuation import BUDGET_STRIDE
    from rft_core.stages.partial import continue_carried

    eos = _ScriptedEngine.EOS
    seqs = [Sequence("a@1", 0, [1, 2], [5, eos], [-1.0, -1.0], [1, 1], "stop"),  # stopped in its first chunk
            Sequence("a@1", 1, [1, 2], [6] * 4, [-1.0] * 4, [1] * 4),  # 4 of 8 tokens: budget 4, ends "length"
            Sequence("b@1", 0, [1, 2], [7] * 6, [-1.0] * 6, [1] * 6),  # 6 of 8: budget 2, ends "length"
            Sequence("b@1", 1, [1, 2], [8], [-1.0], [1]),  # 1 of 8: budget 4, 5 of 8 after it: runs on
            Sequence("c@1", 0, [1, 2], [10, 10], [-1.0] * 2, [1] * 2),  # stops inside this chunk
            Sequence("c@1", 1, [1, 2], [11, eos], [-1.0] * 2, [1] * 2, "stop")]
    engine = _ScriptedEngine({6: [9] * 5, 7: [9] * 3, 8: [9] * 5, 10: [9, eos, 9]})
    cfg = SimpleNamespace(partial=SimpleNamespace(chunk_tokens=4), max_new_tokens=8, temperature=1.0, top_p=1.0,
                          batch_size=8)
    assert continue_carried(engine, seqs, cfg=cfg, version=2, seed=100) == 4
    base = 100 + CONTINUE_OFFSET
    assert [(c[1], c[2], [p[2:] for p in c[0]]) for c in engine.calls] == [
        (2, base + BUDGET_STRIDE * 2, [[7] * 6]), (4, base + BUDGET_STRIDE * 4, [[6] * 4, [8], [10, 10]])]
    assert [(s.tokens, s.versions, s.finish) for s in (seqs[0], seqs[5])] == [  # untouched
        ([5, eos], [1, 1], "stop"), ([11, eos], [1, 1], "stop")]
    assert (seqs[1].tokens, seqs[1].versions, seqs[1].finish) == ([6] * 4 + [9] * 4, [1] * 4 + [2] * 4, "length")
    assert (seqs[2].tokens, seqs[2].finish) == ([7] * 6 + [9] * 2, "length")
    assert (seqs[3].tokens, seqs[3].versions, seqs[3].finish) == ([8] + [9] * 4, [1] + [2] * 4, UNFINISHED)
    assert (seqs[4].tokens, seqs[4].versions, seqs[4].finish) == ([10, 10, 9, eos], [1, 1, 2, 2], "stop")
    assert seqs[4].logprobs == [-1.0, -1.0, -0.5 - 0.9, -0.5]
    done, waiting = split_groups(seqs, iteration=2)
    assert [(s.group, s.sample_index) for s in done] == [("a@1", 0), ("a@1", 1), ("c@1", 0), ("c@1", 1)]
    assert [(s.group, s.sample_index, s.finish) for s in waiting] == [("b@1", 0, "length"), ("b@1", 1, UNFINISHED)]


def test_token_versions_of_a_rollout_without_the_column_repeat_the_row_version():
    table = pa.table({"response_token_ids": [[1, 2, 3], [4]], "policy_version": pa.array([2, None], pa.int32())})
    assert token_versions_of(table) == [[2, 2, 2], [-1]]
    with_column = table.append_column("token_versions", pa.array([[0, 1, 2], [5]], pa.list_(pa.int32())))
    assert token_versions_of(with_column) == [[0, 1, 2], [5]]
    assert torch.tensor(token_versions_of(with_column)[0]).tolist() == [0, 1, 2]
