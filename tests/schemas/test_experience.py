"""zero_pad_sequences, remove_padding_in_sequences, split/make batch as the seed documents them,
and Experience -> Parquet shards -> Experience bit-exact with ragged responses."""
from __future__ import annotations

import pytest
import torch

from schemas import read_shard, schema_for, write_shard
from schemas.experience import (
    BufferItem,
    Experience,
    experience_from_tables,
    experience_to_tables,
    make_experience_batch,
    remove_padding_in_sequences,
    samples_from_tables,
    split_experience_batch,
    zero_pad_sequences,
)
from schemas.shards import ShardSchemaError


def test_zero_pad_sequences_doc_examples():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8, 9])]
    assert zero_pad_sequences(seqs, side="right").tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]
    assert zero_pad_sequences(seqs, side="left").tolist() == [[0, 1, 2, 3], [0, 0, 4, 5], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="side"):
        zero_pad_sequences(seqs, side="middle")
    # min_length widens a batch of short (even empty) rows: [[], [7]] -> width 3
    assert zero_pad_sequences([torch.tensor([], dtype=torch.long), torch.tensor([7])], "right", min_length=3).tolist() == [
        [0, 0, 0], [7, 0, 0]]


def test_remove_padding_doc_example_without_masks():
    item = BufferItem(sequences=torch.tensor([0, 0, 1, 2, 3, 0, 0]), action_log_probs=None, base_action_log_probs=None,
                      values=None, returns=None, advantages=None, attention_mask=None, action_mask=None, info={})
    assert remove_padding_in_sequences([item])[0].sequences.tolist() == [1, 2, 3]


def _experience(seed: int = 0) -> Experience:
    """Ragged batch: prompts of 2..4 tokens, responses of 1..5 tokens."""
    g = torch.Generator().manual_seed(seed)
    p_lens, r_lens = [3, 2, 4, 3], [5, 1, 3, 2]
    prompts = [torch.randint(5, 100, (n,), generator=g) for n in p_lens]
    resps = [torch.randint(5, 100, (n,), generator=g) for n in r_lens]
    A = max(r_lens)
    seq = torch.cat([zero_pad_sequences(prompts, "left"), zero_pad_sequences(resps, "right")], 1)
    att = torch.cat([zero_pad_sequences([torch.ones(n, dtype=torch.long) for n in p_lens], "left"),
                     zero_pad_sequences([torch.ones(n, dtype=torch.long) for n in r_lens], "right")], 1)
    amask = zero_pad_sequences([torch.ones(n, dtype=torch.bool) for n in r_lens], "right")

    def per_tok():
        return torch.where(amask, torch.randn(4, A, generator=g), torch.zeros(()))

    return Experience(
        sequences=seq, action_log_probs=per_tok(), base_action_log_probs=per_tok(), values=per_tok(),
        returns=per_tok(), advantages=per_tok(), attention_mask=att, action_mask=amask, kl=per_tok(),
        action_entropy=per_tok().abs(),
        info={"sample_id": [f"p{i // 2}#{i % 2}" for i in range(4)], "prompt_id": [f"p{i // 2}" for i in range(4)],
              "rewards": torch.tensor([1.0, 0.0, 0.5, 0.25]), "shaped_rewards": torch.tensor([0.9, 0.0, 0.5, 0.2]),
              "response_text": ["a", "b", "c", "d"], "finish_reason": ["stop", "length", "stop", "stop"]},
    )


def test_split_then_make_batch_round_trip():
    exp = _experience()
    items = split_experience_batch(exp)
    assert len(items) == 4 and items[1].sequences.shape == (exp.sequences.shape[1],)
    assert items[2].info["prompt_id"] == "p1"
    back = make_experience_batch(items)
    for name in ("sequences", "attention_mask", "action_mask", "action_log_probs", "advantages", "returns"):
        assert torch.equal(getattr(back, name), getattr(exp, name)), name
    assert torch.equal(back.info["rewards"], exp.info["rewards"])
    with pytest.raises(ValueError):
        make_experience_batch([])
    with pytest.raises(NotImplementedError):
        make_experience_batch(items, packing_samples=True)


def test_remove_padding_then_make_batch_restores_batch():
    exp = _experience()
    items = remove_padding_in_sequences(split_experience_batch(exp))
    # sample 1: prompt of 2 tokens, response of 1 -> 3 tokens, 1 action
    assert items[1].sequences.shape == (3,) and items[1].action_log_probs.shape == (1,)
    assert items[0].sequences.shape == (3 + 5,)
    back = make_experience_batch(items)  # left-pads the whole sequence again
    for i, it in enumerate(items):  # whole sequences are left-padded now: each ends in the last column
        n = len(it.sequences)
        assert back.sequences[i, -n:].tolist() == it.sequences.tolist()
        assert back.sequences[i, :-n].tolist() == [0] * (back.sequences.shape[1] - n)
    assert torch.equal(back.action_log_probs, exp.action_log_probs)


@pytest.mark.parametrize("root", ["file", "memory"])
def test_experience_shard_round_trip_bit_exact(tmp_path, root):
    exp = _experience(seed=5)
    base = f"{tmp_path}/run" if root == "file" else f"memory://rt-{tmp_path.name}"
    tables = experience_to_tables(exp)
    refs = {s: write_shard(t, f"{base}/{s}", schema=schema_for(s), config_hash="h") for s, t in tables.items()}
    read = {s: read_shard(r) for s, r in refs.items()}
    # shuffle row order of a column group: the join on sample_id must undo it
    read["advantages"] = read["advantages"].take([3, 1, 0, 2])
    back = experience_from_tables(read["rollout"], actor=read["actor_logprobs"], ref=read["ref_logprobs"],
                                  rewards=read["rewards"], advantages=read["advantages"], critic=read["critic_values"])
    for name in ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs", "advantages",
                 "returns", "kl", "action_entropy", "values"):
        a, b = getattr(back, name), getattr(exp, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name  # bit-exact
    assert torch.equal(back.info["rewards"], exp.info["rewards"])
    assert back.info["sample_id"] == exp.info["sample_id"]


def test_join_refuses_mismatched_groups():
    tables = experience_to_tables(_experience())
    with pytest.raises(ShardSchemaError, match="advantages: sample_ids"):
        experience_from_tables(tables["rollout"], advantages=tables["advantages"].slice(0, 3))
    bad = tables["actor_logprobs"].set_column(1, "old_logprobs", tables["actor_logprobs"].column("old_logprobs").take([1, 1, 2, 3]))
    with pytest.raises(ShardSchemaError, match="old_logprobs"):
        experience_from_tables(tables["rollout"], actor=bad)


def test_samples_from_rollout_table():
    import pyarrow as pa

    from schemas.columns import PROMPTS

    exp = _experience()
    rollout = experience_to_tables(exp)["rollout"]
    prompts = pa.table({"prompt_id": ["p0", "p1"], "data_source": ["t", "t"], "question": ["q0", "q1"],
                        "prompt_text": ["<q0>", "<q1>"], "prompt_token_ids": [[1], [2]], "answer": ["3", "4"],
                        "metadata_json": ["{}", "{}"], "images": [[], []], "videos": [[], []]},
                       schema=PROMPTS.arrow)
    s = samples_from_tables(rollout, prompts)
    assert torch.equal(s.sequences, exp.sequences) and torch.equal(s.action_mask, exp.action_mask)
    assert s.num_actions == 5 and s.response_length.tolist() == [5, 1, 3, 2]
    assert s.total_length.tolist() == [3 + 5, 2 + 1, 4 + 3, 3 + 2]
    assert s.prompts == ["<q0>", "<q0>", "<q1>", "<q1>"] and s.labels == ["3", "3", "4", "4"]
    with pytest.raises(ShardSchemaError, match="p1"):
        samples_from_tables(rollout, prompts.slice(0, 1))


def _multi_turn_experience() -> Experience:
    """Two multi-turn samples: observation tokens (action_mask False) inside the responses."""
    exp = _experience()
    keep = exp.attention_mask[:, -exp.action_mask.shape[1]:].bool()
    hole = torch.zeros_like(keep)
    hole[0, 1:3] = True  # sample 0: model, obs, obs, model, model
    hole[2, 1] = True  # sample 2: model, obs, model
    exp.action_mask = keep & ~hole
    exp.info["num_turns"] = [2, 1, 2, 1]
    exp.info["tool_calls"] = [[{"turn": 1, "name": "calculator", "arguments": '{"expression": "2*3"}',
                                "observation": "6", "error": None, "seconds": 0.5}], [],
                              [{"turn": 1, "name": None, "arguments": "", "observation": "error: no call",
                                "error": "no call", "seconds": 0.25}], []]
    exp.info["env_reward"] = torch.tensor([1.0, 0.0, 0.5, 0.0])
    exp.info["env_fallback"] = [False, False, True, False]
    exp.info["env_error"] = [None, None, "server down", None]
    exp.info["transcript"] = ["a<obs>b", "", "c<obs>d", ""]
    return exp


def test_multi_turn_columns_round_trip_through_shards(tmp_path):
    exp = _multi_turn_experience()
    tables = experience_to_tables(exp)
    ref = write_shard(tables["rollout"], str(tmp_path / "rollout"), schema=schema_for("rollout"), config_hash="x")
    got = read_shard(ref, stage="rollout").to_pylist()
    assert [r["num_turns"] for r in got] == [2, 1, 2, 1]
    assert got[0]["tool_calls"] == exp.info["tool_calls"][0] and got[2]["tool_calls"] == exp.info["tool_calls"][2]
    assert [r["env_reward"] for r in got] == [1.0, 0.0, 0.5, 0.0]
    assert [r["env_fallback"] for r in got] == [False, False, True, False]
    assert [r["env_error"] for r in got] == [None, None, "server down", None]
    assert [r["transcript"] for r in got] == exp.info["transcript"]
    assert got[0]["action_mask"] == [True, False, False, True, True] and got[2]["action_mask"] == [True, False, True]
    back = experience_from_tables(read_shard(ref, stage="rollout"))
    assert torch.equal(back.action_mask, exp.action_mask) and torch.equal(back.sequences, exp.sequences)
    # without the multi-turn info the rows are single-turn
    single = experience_to_tables(_experience())["rollout"].to_pylist()[1]
    assert (single["num_turns"], single["tool_calls"], single["env_reward"], single["env_fallback"],
            single["env_error"], single["transcript"]) == (1, [], 0.0, False, None, single["response_text"])


def test_remove_padding_keeps_the_observation_tokens_inside_a_response():
    exp = _multi_turn_experience()
    items = remove_padding_in_sequences(split_experience_batch(exp))
    assert [len(it.action_mask) for it in items] == [5, 1, 3, 2]  # the response lengths, holes kept
    assert items[0].action_mask.tolist() == [True, False, False, True, True]
    assert items[2].action_mask.tolist() == [True, False, True]
    assert [len(it.sequences) for it in items] == [3 + 5, 2 + 1, 4 + 3, 3 + 2]
    # without an attention mask, only the run of False at the end of action_mask is padding
    bare = [BufferItem(sequences=it.sequences, action_log_probs=None, base_action_log_probs=None, values=None,
                       returns=None, advantages=None, attention_mask=None, action_mask=m, info={})
            for it, m in zip(split_experience_batch(exp)[:1], [torch.tensor([True, False, True, False, False])])]
    seq = bare[0].sequences
    assert seq[0] == 0 and seq[1] != 0  # one left-padding zero (sample 0's prompt is 3 of 4 columns)
    assert torch.equal(remove_padding_in_sequences(bare)[0].sequences, seq[1:-2])
