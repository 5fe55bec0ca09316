"""Partial rollouts (``rollout.partial``, issue 48): a token budget per iteration, sequences
carried over in the rollout shard, a trajectory's tokens from several policy versions.

The schedule (docs/algorithms.md, "Partial rollouts"). The rollout of iteration k, with policy
version v(k) (``TrainConfig.rollout_policy_version``) and N = ``rollout.partial.chunk_tokens``:

1. continues every unfinished sequence carried by the rollout of iteration k-1 (its ``carry/``
   tables) by at most min(N, max_new_tokens - its length) new tokens, from its tokens
   (``rft_core.engines.continuation``), and starts the groups of iteration k's own prompts with at
   most min(N, max_new_tokens) tokens each;
2. a sequence is finished at its EOS ("stop") or at ``max_new_tokens`` ("length"); otherwise it
   is unfinished ("partial");
3. a group (a prompt's n samples) whose samples have all finished enters training now: its rows
   are the rollout shard's rows; every other group is committed whole in the same shard's
   ``carry/rollout.parquet`` (finished samples wait for their group, so a group baseline always
   sees the whole group, as slime's data buffer keeps groups whole) with its prompt row in
   ``carry/prompts.parquet``. A group started by iteration k and carried is renamed
   ``{prompt_id}@{k}`` (its rows ``{prompt_id}@{k}#{j}``), so it never meets a later group of the
   same prompt (the data order repeats prompts across epochs).

Nothing lives only in memory: the carry is committed with the rollout's rows under one manifest,
so a resumed run, a retried stage or a restarted resident worker continues the same sequences.

Every token keeps its behaviour log-prob (``rollout_logprobs``, under the policy that sampled
it) and that policy's version (``token_versions``, AReaL's ``ModelResponse.output_versions``);
a row's ``policy_version`` is the newest of them. The rollout correction weighs each token by
pi_prox / pi_behaviour of its own version (decoupled PPO; slime PR #2092 left tokens of older
versions unweighted).

Seeds: the new groups are ``engine.generate`` with ``rollout_seed`` as before; the continued
sequences are ``continue_sequences`` with ``rollout_seed + CONTINUE_OFFSET`` (the sequences
continued in that order: the carry's rows, groups in the order their prompt rows have in the
prompts shard, samples by index). A rollout is therefore a pure function of its committed
inputs (prompts, carry, policy) and the config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rft_core.engines.continuation import continue_sequences
from schemas import ShardRef, ShardSchemaError, read_side_table
from schemas.columns import PROMPTS, ROLLOUT, single_turn_columns

CARRY_ROLLOUT = "carry/rollout.parquet"
CARRY_PROMPTS = "carry/prompts.parquet"
UNFINISHED = "partial"  # finish_reason of a carried sequence whose last chunk reached its token budget
# the start of the log line a partial rollout writes right before it generates (its carried sequences'
# next chunks, then the new groups' first): what a fault row waits for (tests/test_faults_async.py)
CONTINUING_LINE = "rollout: continuing"
CONTINUE_OFFSET = 50_021  # the continued sequences' seed: rollout_seed + CONTINUE_OFFSET


@dataclass
class Sequence:
    """One sample of a group in flight.

    Attributes:
        group: the group's prompt_id in the shards (``{prompt_id}@{k}`` once carried).
        sample_index: 0..n-1 inside the group.
        prompt: the prompt's token ids.
        tokens, logprobs, versions: per response token so far: token id, behaviour log-prob
            (float, under the distribution it was sampled from), policy version (int).
        finish: "stop", "length" or ``UNFINISHED``.
    """

    group: str
    sample_index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = UNFINISHED

    def extend(self, tokens: list[int], logprobs: list[float], version: int, engine_finish: str, max_new: int) -> None:
        """Append one chunk sampled by policy ``version``; ``engine_finish`` is the engine's
        ("stop" at an EOS, else "length" at the chunk's budget)."""
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += [version] * len(tokens)
        self.finish = "stop" if engine_finish == "stop" else ("length" if len(self.tokens) >= max_new else UNFINISHED)


def read_carry(ref: ShardRef) -> tuple[pa.Table, pa.Table]:
    """The sequences a committed partial rollout carries over and their prompt rows:
    (``carry/rollout.parquet`` as a ROLLOUT table with ``token_versions``, ``carry/prompts.parquet``
    as a PROMPTS table), both checked against the manifest like its parts.

    Raises:
        ShardSchemaError: ``ref`` is a rollout without a carry (not a partial rollout), or a
            table of the wrong schema.
        ShardCorruptError: a carry file is missing, truncated or corrupted.
    """
    return read_side_table(ref, CARRY_ROLLOUT, ROLLOUT), read_side_table(ref, CARRY_PROMPTS, PROMPTS)


def prompts_with_carry(fresh: pa.Table, carry: ShardRef) -> pa.Table:
    """Iteration k's prompts: its own (``fresh``) then the prompt rows of the groups the rollout
    of iteration k-1 carries (``carry``), which the rewards stage grades when they finish.

    Raises:
        ShardSchemaError: a carried group's id is also a new prompt's (a data source named with '@').
    """
    _, carried = read_carry(carry)
    clash = sorted(set(fresh.column("prompt_id").to_pylist()) & set(carried.column("prompt_id").to_pylist()))
    if clash:
        raise ShardSchemaError(f"{carry.uri}: carried group {clash[0]!r} has the id of one of this iteration's prompts "
                               "(a prompt id with '@'): rename the data source")
    return pa.concat_tables([fresh.cast(PROMPTS.arrow), carried.cast(PROMPTS.arrow)])


def carried_sequences(carry: pa.Table) -> list[Sequence]:
    """The ``Sequence``s of a carry table, in its row order."""
    cols = [carry.column(c).to_pylist() for c in ("prompt_id", "sample_index", "prompt_token_ids", "response_token_ids",
                                                 "rollout_logprobs", "token_versions", "finish_reason")]
    return [Sequence(g, k, p, list(t), list(lp), list(v), f) for g, k, p, t, lp, v, f in zip(*cols)]


def continue_carried(engine, seqs: list[Sequence], *, cfg, version: int, seed: int, progress=None) -> int:
    """Give every unfinished sequence of ``seqs`` its next chunk (``cfg``: ``RolloutConfig``),
    sampled by policy ``version``; returns how many were continued."""
    todo = [s for s in seqs if s.finish == UNFINISHED]
    if not todo:
        return 0
    budgets = [min(cfg.partial.chunk_tokens, cfg.max_new_tokens - len(s.tokens)) for s in todo]
    gens = continue_sequences(engine, [s.prompt + s.tokens for s in todo], budgets, temperature=cfg.temperature,
                              top_p=cfg.top_p, batch_size=cfg.batch_size, seed=seed + CONTINUE_OFFSET, progress=progress)
    for s, g in zip(todo, gens):
        s.extend(list(g.response_token_ids), list(g.logprobs), version, g.finish_reason, cfg.max_new_tokens)
    return len(todo)


def started_sequences(gens, prompt_ids: list[list[int]], groups: list[str], *, version: int,
                      max_new: int) -> list[Sequence]:
    """The ``Sequence``s of a fresh ``engine.generate`` over ``prompt_ids`` (its first chunk),
    group p named ``groups[p]``."""
    out = []
    for g in gens:
        s = Sequence(groups[g.prompt_index], g.sample_index, list(prompt_ids[g.prompt_index]))
        s.extend(list(g.response_token_ids), list(g.logprobs), version, g.finish_reason, max_new)
        out.append(s)
    return out


def split_groups(seqs: list[Sequence], *, iteration: int) -> tuple[list[Sequence], list[Sequence]]:
    """(the sequences of the groups whose samples have all finished, those of the others); a
    group carried for the first time (its id has no '@') is renamed ``{group}@{iteration}``."""
    open_groups = {s.group for s in seqs if s.finish == UNFINISHED}
    done = [s for s in seqs if s.group not in open_groups]
    waiting = [s for s in seqs if s.group in open_groups]
    for s in waiting:
        if "@" not in s.group:
            s.group = f"{s.group}@{iteration}"
    return done, waiting


def sequence_table(seqs: list[Sequence], prompts: pa.Table, tok) -> pa.Table:
    """The rollout rows (ROLLOUT schema with ``token_versions``) of ``seqs``, ordered by their
    group's prompt row in ``prompts`` (a carried group's row has its ``@`` id; a new group's
    its own) and sample index; images and videos are the prompt row's."""
    pids = prompts.column("prompt_id").to_pylist()
    position = {p: i for i, p in enumerate(pids)}
    base = lambda group: group if group in position else group.rsplit("@", 1)[0]  # noqa: E731
    seqs = sorted(seqs, key=lambda s: (position[base(s.group)], s.sample_index))
    images, videos = prompts.column("images").to_pylist(), prompts.column("videos").to_pylist()
    texts = tok.batch_decode([s.tokens for s in seqs], skip_special_tokens=True) if seqs else []
    rows: dict[str, Any] = {
        "sample_id": [f"{s.group}#{s.sample_index}" for s in seqs],
        "prompt_id": [s.group for s in seqs],
        "sample_index": [s.sample_index for s in seqs],
        "prompt_token_ids": [s.prompt for s in seqs],
        "response_token_ids": [s.tokens for s in seqs],
        "response_text": texts,
        "rollout_logprobs": [s.logprobs for s in seqs],
        "action_mask": [[True] * len(s.tokens) for s in seqs],
        "finish_reason": [s.finish for s in seqs],
        "images": [images[position[base(s.group)]] for s in seqs],
        "videos": [videos[position[base(s.group)]] for s in seqs],
        **single_turn_columns(texts),
        "policy_version": [max(s.versions) for s in seqs],
        "token_versions": [s.versions for s in seqs],
    }
    return pa.table(rows, schema=ROLLOUT.arrow_with(["token_versions"]))


def carried_prompt_rows(waiting: list[Sequence], prompts: pa.Table) -> pa.Table:
    """The prompt rows of the carried groups (under their ``@`` ids), in ``prompts``' order."""
    pids = prompts.column("prompt_id").to_pylist()
    groups = {s.group.rsplit("@", 1)[0] if s.group not in pids else s.group: s.group for s in waiting}
    keep = [i for i, p in enumerate(pids) if p in groups]
    table = prompts.take(pa.array(keep, pa.int64()))
    renamed = pa.array([groups[p] for p in table.column("prompt_id").to_pylist()], pa.string())
    return table.set_column(table.schema.get_field_index("prompt_id"), "prompt_id", renamed).cast(PROMPTS.arrow)


def partial_summary(done: list[Sequence], waiting: list[Sequence], *, iteration: int, continued: int) -> dict[str, Any]:
    """What the rollout manifest records of a partial rollout (``iteration_metrics`` reads the scalars):

    - ``partial_finished_groups`` / ``partial_carried_groups``: groups entering training now /
      committed in the carry; ``partial_carried_sequences``: unfinished sequences among them;
      ``partial_continued_sequences``: carried sequences this rollout gave a chunk.
    - over the rows entering training: ``multi_version_frac`` (fraction of trajectories whose
      tokens come from more than one policy version), ``version_span_tokens_mean`` (mean length
      of a maximal run of tokens sampled by one version), ``token_staleness_mean`` /
      ``token_staleness_max`` (per token, (iteration - 1) - its version: updates between its
      behaviour policy and the proximal one) and ``tokens_by_staleness`` ({staleness: tokens}).
    """
    spans, stale = [], []
    for s in done:
        run = 0
        for j, v in enumerate(s.versions):
            run += 1
            if j + 1 == len(s.versions) or s.versions[j + 1] != v:
                spans.append(run)
                run = 0
        stale += [iteration - 1 - v for v in s.versions]
    by_stale: dict[str, int] = {}
    for d in stale:
        by_stale[str(d)] = by_stale.get(str(d), 0) + 1
    return {"partial_finished_groups": len({s.group for s in done}), "partial_carried_groups": len({s.group for s in waiting}),
            "partial_carried_sequences": sum(s.finish == UNFINISHED for s in waiting),
            "partial_continued_sequences": continued,
            "multi_version_frac": sum(len(set(s.versions)) > 1 for s in done) / max(len(done), 1),
            "version_span_tokens_mean": sum(spans) / max(len(spans), 1),
            "token_staleness_mean": sum(stale) / max(len(stale), 1), "token_staleness_max": max(stale, default=0),
            "tokens_by_staleness": dict(sorted(by_stale.items(), key=lambda kv: int(kv[0])))}
