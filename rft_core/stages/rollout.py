"""Rollout stage: sample a group of responses per prompt with the current policy."""
from __future__ import annotations

import logging
import os
import socket

import pyarrow as pa
import pyarrow.compute as pc

from rft_core.agents import AgentRollout, EnvFactory
from rft_core.agents.env import environment_fingerprint
from rft_core.config import RolloutConfig
from rft_core.config.scale import SGLangConfig, VLLMConfig
from rft_core.counters import count
from rft_core.engines.hf import HFEngine
from rft_core.engines.sglang import get_sglang_engine
from rft_core.engines.vllm import get_vllm_engine
from rft_core.models.loading import load_tokenizer, resolve_model_path
from rft_core.models.lora import adapter_base_path, is_adapter_dir
from rft_core.models.vl import vl_processor_or_none
from rft_core.progress import progress_reporter
from rft_core.stages.checkpoints import policy_model_path
from rft_core.stages.common import Commit, Timer, reuse_or_compute, stage_commit
from rft_core.stages.contracts import RolloutInput, RolloutMergeInput, stage_program
from rft_core.stages.partial import (
    CARRY_PROMPTS,
    CARRY_ROLLOUT,
    CONTINUING_LINE,
    UNFINISHED,
    carried_prompt_rows,
    carried_sequences,
    continue_carried,
    partial_summary,
    read_carry,
    sequence_table,
    split_groups,
    started_sequences,
)
from rft_core.stages.sources import config_folder, current_source, inference_model
from schemas import PolicyRef, ShardRef, read_manifest, read_shard
from schemas.columns import PROMPTS, ROLLOUT, policy_version_column, single_turn_columns

SEED_STRIDE = 100_003  # iteration i samples with seed + i * stride: distinct, reproducible streams
ATTEMPT_STRIDE = 7_919  # dynamic-sampling refill attempts: another offset

log = logging.getLogger("rft_core.stages")


def rollout_summary(table: pa.Table, *, agent: bool = False) -> dict[str, float]:
    """Statistics of a rollout table: the mean response length (tokens after the prompt, model
    and observation tokens) and the fraction of rows cut by a token budget (finish_reason
    "length"). With ``agent`` (a multi-turn rollout) also, per trajectory: ``model_tokens_mean``
    (tokens the model sampled: the ``action_mask``), ``num_turns_mean`` (model turns),
    ``tool_call_rate`` (fraction of trajectories with at least one tool call, i.e. a step whose
    ``tool_calls`` record names a tool), ``tool_calls_mean`` (environment steps recorded),
    ``tool_error_frac`` (fraction of those records with an error), ``env_reward_mean``,
    ``env_fallback_frac``, and ``max_turns_fraction`` (finish_reason "max_turns"). An empty table
    (a partial-rollout iteration in which no group finished) has none of them: {}."""
    if table.num_rows == 0:
        return {}
    n = table.num_rows
    lengths = pc.list_value_length(table.column("response_token_ids")).to_pylist()
    finish = table.column("finish_reason").to_pylist()
    out = {"response_length_mean": sum(lengths) / n, "truncated_fraction": sum(f == "length" for f in finish) / n}
    if agent:
        calls = table.column("tool_calls").to_pylist()
        records = [c for row in calls for c in row]
        out.update(
            model_tokens_mean=sum(sum(m) for m in table.column("action_mask").to_pylist()) / n,
            num_turns_mean=sum(table.column("num_turns").to_pylist()) / n,
            tool_call_rate=sum(any(c["name"] is not None for c in row) for row in calls) / n,
            tool_calls_mean=len(records) / n,
            tool_error_frac=sum(c["error"] is not None for c in records) / max(len(records), 1),
            env_reward_mean=sum(table.column("env_reward").to_pylist()) / n,
            env_fallback_frac=sum(table.column("env_fallback").to_pylist()) / n,
            max_turns_fraction=sum(f == "max_turns" for f in finish) / n)
    return out


def engine_eos_ids(tok, model_path: str) -> set[int]:
    """Token ids that end a response for a GPU engine: the tokenizer's EOS plus the model's
    ``generation_config.json`` EOS (one id or a list), as the HF engine uses."""
    from transformers import GenerationConfig

    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        eos |= set([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    except OSError:  # no generation_config.json
        pass
    return eos


def make_engine(cfg: RolloutConfig, policy: PolicyRef, *, dtype: str):
    """The rollout engine of ``cfg.engine`` for ``policy`` (a model folder, alias or hub id, a
    LoRA adapter folder, or a committed update) and its tokenizer: (engine, tokenizer).

    ``hf``: an ``HFEngine`` on ``default_device()`` in ``dtype`` over the policy's weights
    (``inference_model``: loaded from storage, or a resident worker's copy). ``vllm`` / ``sglang``: the
    process's cached GPU engine (``get_vllm_engine`` / ``get_sglang_engine``), reused across
    iterations with the new checkpoint loaded in place while the base model and settings stay
    the same; it is given the policy dtype as it is (the engine maps float32/auto to a 16-bit
    dtype itself: ``rft_core.engines.engine_dtype``). A LoRA checkpoint is served on its base
    model as an adapter.

    Inside a resident worker (``rft_core.stages.sources.current_source``), a vLLM/SGLang engine is built (or reused
    without reloading) from ``config_folder(policy)``, the checkpoint ``policy``'s weights
    descend from (an update that kept its weights in memory has no weights on storage:
    ``policy_model_path`` raises ``WeightlessPolicyError``), as a full model, or for a LoRA run
    (``ModelSource.engine_lora``) as a LoRA engine on the base, and gets ``policy``'s weights (a
    LoRA policy's adapters) from ``source.engine_policy`` (``ModelSource.engine_policy``: an
    in-memory sync, ``rft_core.weightsync``).
    """
    path = config_folder(policy)
    tok = load_tokenizer(path)
    if cfg.engine == "hf":
        if current_source() is None:
            count("engine_builds")  # over a model read for it (a resident worker's engine is built once)
        return HFEngine(inference_model(policy, dtype=dtype), tok), tok
    source = current_source()
    synced = source is not None  # weights from the resident worker's memory (ModelSource.engine_policy)
    if not synced:
        path = policy_model_path(policy)
    lora = path if is_adapter_dir(path) else None
    base = resolve_model_path(adapter_base_path(path) if lora else path)
    adapters = synced and getattr(source, "engine_lora", False)  # a LoRA run: the worker lands each version's adapters
    if synced:
        lora = None  # the engine is built on the base; the worker's sync gives it what to serve
    eos = engine_eos_ids(tok, base)
    if cfg.engine == "vllm":
        v = cfg.vllm or VLLMConfig()
        engine = get_vllm_engine(base, eos_ids=eos, lora_path=lora, tensor_parallel_size=v.tensor_parallel_size,
                                 gpu_memory_utilization=v.gpu_memory_utilization, dtype=dtype,
                                 max_model_len=v.max_model_len, enable_sleep_mode=v.enable_sleep_mode,
                                 max_lora_rank=v.max_lora_rank, enable_lora=adapters, reload=not synced)
    else:
        sg = cfg.sglang or SGLangConfig()
        engine = get_sglang_engine(base, eos_ids=eos, lora_path=lora, tensor_parallel_size=sg.tensor_parallel_size,
                                   mem_fraction_static=sg.mem_fraction_static, dtype=dtype,
                                   max_model_len=sg.max_model_len, enable_memory_saver=sg.enable_memory_saver,
                                   max_lora_rank=sg.max_lora_rank, deterministic=sg.deterministic, enable_lora=adapters,
                                   reload=not synced)
    if synced:
        source.engine_policy(engine, policy)
    return engine, tok


@stage_program(RolloutInput)
def run(inp: RolloutInput) -> ShardRef:
    """Generate ``rollout.n_samples_per_prompt`` responses per prompt; write the rollout shard.

    sample_id = ``{prompt_id}#{k}`` with k the sample's index in its group. ``rollout_logprobs``
    are each token's log-prob under the distribution the engine sampled it from (the HF engine:
    that step's temperature and top-p nucleus, ``rft_core.engines.hf.StepLogprobs``). A
    vision-language policy (its ``VLProcessor`` loaded from the model folder) gets its prompts'
    images and videos with every batch; it needs ``rollout.engine=hf``. Dynamic-sampling
    refill ``attempt`` k samples with its own seed. With ``shard`` (index, count), only the
    engine batches b with b % count == index are generated, each seeded as in the whole
    rollout; ``run_merge`` of the ``count`` shards gives exactly the single-worker rollout (the
    fan-out over Ray workers).

    With ``rollout.agent`` the rollout is multi-turn (``_commit_agent_rollout``): each sample is
    a trajectory of model turns and environment observations; a user environment's source
    file enters the config hash (``environment_fingerprint``).

    With ``rollout.partial`` (``_commit_partial_rollout``; ``rft_core.stages.partial``): at most
    ``chunk_tokens`` new tokens per unfinished sequence; the sequences ``inp.carry`` (the previous
    rollout) carried are continued from their tokens, the new prompts' groups started; the
    finished groups are the shard's rows (with ``token_versions``), the others are committed in
    its ``carry/`` side tables.

    With ``inp.greedy`` (ReMax's baseline): one greedy (argmax) response per prompt with the same
    engine, policy and ``max_new_tokens`` (sample_id ``{prompt_id}#0``; temperatures, top-p, FIRE
    and the seed play no part); the summary says ``decoding: greedy``.
    """
    cfg, shard = inp.rollout, inp.shard
    env_code = environment_fingerprint(cfg.agent.environment) if cfg.agent is not None else None
    commit = stage_commit(inp, env_code=env_code)  # a user environment's source file counts as config

    def compute() -> ShardRef:
        table = read_shard(inp.prompts, stage="prompts")
        path = config_folder(inp.policy)
        if cfg.agent is not None:
            return _commit_agent_rollout(inp, commit, table, path)
        processor = vl_processor_or_none(path)  # a vision-language policy: its media go with every batch
        if processor is not None and cfg.engine != "hf":
            raise ValueError(f"rollout.engine={cfg.engine!r} does not take images or videos; the vision-language "
                             f"policy {path} rolls out with rollout.engine=hf")
        if cfg.partial is not None and not inp.greedy:
            if processor is not None:
                raise ValueError(f"rollout.partial continues text sequences, but {path} is a vision-language policy: "
                                 "unset rollout.partial")
            return _commit_partial_rollout(inp, commit, table)
        engine, tok = make_engine(cfg, inp.policy, dtype=inp.dtype)
        prompt_ids = table.column("prompt_token_ids").to_pylist()
        images, videos = table.column("images").to_pylist(), table.column("videos").to_pylist()
        vision = {"images": images, "videos": videos, "processor": processor} if processor is not None else {}
        only = None
        n = 1 if inp.greedy else cfg.n_samples_per_prompt
        if shard is not None:
            n_batches = len(engine.batches(prompt_ids, n, cfg.batch_size))
            only = {b for b in range(n_batches) if b % shard[1] == shard[0]}
        decoding = {"greedy": True, "first_token_temperature": None} if inp.greedy else {
            "first_token_temperature": cfg.first_token_temperature}
        with Timer() as t, progress_reporter("rollout", unit="sequences") as progress:
            gens = engine.generate(prompt_ids, n_samples_per_prompt=n, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, top_p=cfg.top_p, batch_size=cfg.batch_size,
                                   seed=rollout_seed(inp), progress=progress, only_batches=only, **decoding, **vision)
        table_out = _rollout_table(table, gens, tok, prompt_ids, images, videos, inp.policy_version)
        n_tokens = sum(len(g.response_token_ids) for g in gens)
        summary = {"seconds": t.seconds, "generated_tokens": n_tokens, "tokens_per_second": n_tokens / max(t.seconds, 1e-9),
                   **rollout_summary(table_out), **version_summary(inp), **({"decoding": "greedy"} if inp.greedy else {})}
        if shard is not None:
            summary.update({"shard": list(shard), "worker": f"{socket.gethostname()}:{os.getpid()}"})
        return commit.write(table_out, schema=ROLLOUT, inputs=rollout_inputs(inp), summary=summary)

    return reuse_or_compute(commit, compute)


def _commit_partial_rollout(inp: RolloutInput, commit: Commit, prompts: pa.Table) -> ShardRef:
    """The partial rollout of ``inp`` (``rollout.partial``; ``rft_core.stages.partial``): the
    carried sequences of ``inp.carry`` continued by one chunk, ``prompts``' new groups started
    with one; the finished groups are the shard's rows, the others its carry.

    Raises:
        ValueError: a carried group whose prompt row is not in ``prompts`` (the prompts stage was
            not given the same carry).
    """
    cfg = inp.rollout
    assert cfg.partial is not None
    carried = carried_sequences(read_carry(inp.carry)[0]) if inp.carry is not None else []
    pids = prompts.column("prompt_id").to_pylist()
    groups = {s.group for s in carried}
    if groups - set(pids):
        raise ValueError(f"rollout: carried groups {sorted(groups - set(pids))[:3]} have no prompt row in {inp.prompts.uri}: "
                         "the prompts stage must be given the same carry (the previous iteration's rollout)")
    fresh = [i for i, p in enumerate(pids) if p not in groups]
    all_ids = prompts.column("prompt_token_ids").to_pylist()
    prompt_ids = [all_ids[i] for i in fresh]
    engine, tok = make_engine(cfg, inp.policy, dtype=inp.dtype)
    version, seed = inp.policy_version, rollout_seed(inp)
    before = sum(len(s.tokens) for s in carried)  # tokens the carried sequences had: not generated here
    unfinished = sum(s.finish == UNFINISHED for s in carried)
    # the line a fault row waits for before it kills a run inside this generation (tests/test_faults_async.py)
    log.info("%s %d carried sequence(s) of %d group(s), then %d new group(s) (policy version %d)", CONTINUING_LINE,
             unfinished, len(groups), len(fresh), version)
    with Timer() as t, progress_reporter("rollout", unit="sequences") as progress:
        continued = continue_carried(engine, carried, cfg=cfg, version=version, seed=seed, progress=progress)
        gens = engine.generate(prompt_ids, n_samples_per_prompt=cfg.n_samples_per_prompt,
                               max_new_tokens=min(cfg.partial.chunk_tokens, cfg.max_new_tokens),
                               temperature=cfg.temperature, top_p=cfg.top_p, batch_size=cfg.batch_size, seed=seed,
                               first_token_temperature=cfg.first_token_temperature, progress=progress)
    seqs = carried + started_sequences(gens, prompt_ids, [pids[i] for i in fresh], version=version,
                                       max_new=cfg.max_new_tokens)
    done, waiting = split_groups(seqs, iteration=inp.iteration)
    table_out = sequence_table(done, prompts, tok)
    n_tokens = sum(len(s.tokens) for s in seqs) - before
    summary = {"seconds": t.seconds, "generated_tokens": n_tokens, "tokens_per_second": n_tokens / max(t.seconds, 1e-9),
               **rollout_summary(table_out), **version_summary(inp),
               **partial_summary(done, waiting, iteration=inp.iteration, continued=continued)}
    side = {CARRY_ROLLOUT: (sequence_table(waiting, prompts, tok), ROLLOUT),
            CARRY_PROMPTS: (carried_prompt_rows(waiting, prompts), PROMPTS)}
    return commit.write(table_out, schema=ROLLOUT, inputs=rollout_inputs(inp), summary=summary, side_tables=side)


def version_summary(inp: RolloutInput) -> dict[str, int]:
    """The rollout manifest's record of its policy: ``policy_version`` (the update it comes
    from; 0: the initial policy) and ``staleness`` (updates between it and the policy this
    iteration's update starts from: ``iteration - 1 - policy_version``)."""
    return {"policy_version": inp.policy_version, "staleness": inp.iteration - 1 - inp.policy_version}


def rollout_inputs(inp: RolloutInput) -> dict[str, ShardRef]:
    """The rollout manifest's inputs: its prompts, the committed update whose policy generated it
    and, for a partial rollout, the previous rollout whose carried sequences it continued."""
    return {"prompts": inp.prompts, **({"policy": inp.policy} if isinstance(inp.policy, ShardRef) else {}),
            **({"carry": inp.carry} if inp.carry is not None else {})}


def rollout_seed(inp: RolloutInput) -> int:
    """The base seed of a rollout: ``rollout.seed + SEED_STRIDE * iteration + ATTEMPT_STRIDE *
    attempt`` (per-sample seeds are derived from it and the sample's global indices)."""
    return inp.rollout.seed + SEED_STRIDE * inp.iteration + ATTEMPT_STRIDE * inp.attempt


def agent_rows(prompts: pa.Table, trajectories, tok, prompt_indices: list[int]) -> dict[str, list]:
    """The rollout columns of multi-turn ``trajectories`` (``rft_core.agents.Trajectory``, in
    their order) of the prompt rows ``prompt_indices`` of ``prompts`` (trajectory
    ``prompt_index`` p is row ``prompt_indices[p]``).

    ``prompt_token_ids`` are the trajectory's (the prompt plus the environment's first
    observation, when ``reset`` returned one); ``action_mask`` is True exactly on the tokens the
    model sampled, ``rollout_logprobs`` 0.0 on observation tokens; ``response_text`` is the LAST
    model turn's text (what the reward stage grades: graded on the whole transcript, a "last
    number" grader would pick up the calculator's output, a reward hack); ``transcript`` the whole
    response decoded with special tokens.
    """
    pids = prompts.column("prompt_id").to_pylist()
    rows = [prompt_indices[t.prompt_index] for t in trajectories]
    return {
        "sample_id": [f"{pids[r]}#{t.sample_index}" for r, t in zip(rows, trajectories)],
        "prompt_id": [pids[r] for r in rows],
        "sample_index": [t.sample_index for t in trajectories],
        "prompt_token_ids": [t.prompt_token_ids for t in trajectories],
        "response_token_ids": [t.response_token_ids for t in trajectories],
        "response_text": [t.final_text for t in trajectories],
        "rollout_logprobs": [t.logprobs for t in trajectories],
        "action_mask": [t.is_model for t in trajectories],
        "finish_reason": [t.finish_reason for t in trajectories],
        "images": [[] for _ in trajectories],
        "videos": [[] for _ in trajectories],
        "num_turns": [t.num_turns for t in trajectories],
        "tool_calls": [t.tool_calls for t in trajectories],
        "env_reward": [t.env_reward for t in trajectories],
        "env_fallback": [t.env_fallback for t in trajectories],
        "env_error": [t.env_error for t in trajectories],
        "transcript": tok.batch_decode([t.response_token_ids for t in trajectories], skip_special_tokens=False),
    }


def _commit_agent_rollout(inp: RolloutInput, commit: Commit, table: pa.Table, path: str) -> ShardRef:
    """The multi-turn rollout of ``inp`` (``rollout.agent`` set) on ``default_device()``: one
    trajectory per sample (``rft_core.agents.AgentRollout``), seeded per sample from
    ``rollout_seed`` and the prompt's index in the whole prompts shard, so with ``shard``
    (index, count) the prompts p with p % count == index give their trajectories of the whole
    rollout (up to the floating-point effect of batch padding on the logits).

    Raises:
        ValueError: a vision-language policy (multi-turn rollouts are text-only), or prompts
            with images or videos.
        EnvConfigError: an unknown environment or bad ``env_config``.
        EnvError: an environment failed with ``on_env_error: raise``.
    """
    cfg, shard = inp.rollout, inp.shard
    assert cfg.agent is not None
    if vl_processor_or_none(path) is not None:
        raise ValueError(f"rollout.agent: multi-turn rollouts take a text-only policy, but {path} is a vision-language "
                         "model; unset rollout.agent or train a text-only model")
    EnvFactory(cfg.agent.environment, cfg.agent.env_config)  # bad settings fail before the model loads
    tok = load_tokenizer(path)
    agent = AgentRollout(inference_model(inp.policy, dtype=inp.dtype).eval(), tok, cfg.agent)
    rows = table.to_pylist()
    idx = [p for p in range(len(rows)) if shard is None or p % shard[1] == shard[0]]
    with Timer() as t, progress_reporter("rollout", unit="trajectories") as progress:
        trajectories = agent.run([rows[p] for p in idx], n_samples_per_prompt=cfg.n_samples_per_prompt,
                                 temperature=cfg.temperature, top_p=cfg.top_p, batch_size=cfg.batch_size,
                                 seed=rollout_seed(inp), prompt_indices=idx, progress=progress)
    table_out = pa.table({**agent_rows(table, trajectories, tok, idx),
                          **policy_version_column(len(trajectories), inp.policy_version)}, schema=ROLLOUT.arrow)
    n_tokens = sum(sum(tr.is_model) for tr in trajectories)
    summary = {"seconds": t.seconds, "generated_tokens": n_tokens, "tokens_per_second": n_tokens / max(t.seconds, 1e-9),
               "environment": cfg.agent.environment, **rollout_summary(table_out, agent=True), **version_summary(inp)}
    if shard is not None:
        summary.update({"shard": list(shard), "worker": f"{socket.gethostname()}:{os.getpid()}"})
    return commit.write(table_out, schema=ROLLOUT, inputs=rollout_inputs(inp), summary=summary)


def _rollout_table(prompts: pa.Table, gens, tok, prompt_ids: list[list[int]], images: list, videos: list,
                   policy_version: int | None) -> pa.Table:
    """The rollout rows of the engine's generations (in generation order); each row carries its
    prompt's encoded images and videos as stored in the prompts shard (the same bytes) and the
    version of the policy that generated it."""
    pids = prompts.column("prompt_id").to_pylist()
    texts = tok.batch_decode([g.response_token_ids for g in gens], skip_special_tokens=True)
    rows = {
        "sample_id": [f"{pids[g.prompt_index]}#{g.sample_index}" for g in gens],
        "prompt_id": [pids[g.prompt_index] for g in gens],
        "sample_index": [g.sample_index for g in gens],
        "prompt_token_ids": [prompt_ids[g.prompt_index] for g in gens],
        "response_token_ids": [g.response_token_ids for g in gens],
        "response_text": texts,
        "rollout_logprobs": [g.logprobs for g in gens],
        "action_mask": [[True] * len(g.response_token_ids) for g in gens],
        "finish_reason": [g.finish_reason for g in gens],
        "images": [images[g.prompt_index] for g in gens],
        "videos": [videos[g.prompt_index] for g in gens],
        **single_turn_columns(texts),
        **policy_version_column(len(gens), policy_version),
    }
    return pa.table(rows, schema=ROLLOUT.arrow)


@stage_program(RolloutMergeInput)
def run_merge(inp: RolloutMergeInput) -> ShardRef:
    """The rollout of ``inp.rollout`` from its shards ``inp.parts``: rows in prompt order then
    sample index, as the single-worker rollout writes them, under the same contract and config
    hash (so either can stand for the other on resume). The manifest records what the
    single-worker rollout's does: its prompts and policy among the inputs (and the shards), the
    rollout summary of the merged rows, and ``policy_version`` / ``staleness``
    (``version_summary``), which the iteration's metrics read.

    Raises:
        ValueError: the parts do not hold every (prompt, sample) exactly once, or a part's
            manifest records another policy version than ``inp.rollout``'s.
    """
    commit = stage_commit(inp)
    parts, n_samples = inp.parts, 1 if inp.rollout.greedy else inp.rollout.rollout.n_samples_per_prompt

    def compute() -> ShardRef:
        order = {pid: i for i, pid in enumerate(read_shard(inp.rollout.prompts, stage="prompts").column("prompt_id").to_pylist())}
        tables = [read_shard(p, stage="rollout") for p in parts]
        table = pa.concat_tables(tables)
        keys = list(zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist()))
        want = {(pid, k) for pid in order for k in range(n_samples)}
        if len(keys) != len(set(keys)) or set(keys) != want:
            raise ValueError(f"rollout shards hold {len(keys)} rows ({len(set(keys))} distinct) but the prompts need "
                             f"{len(want)}: shards missing or overlapping")
        table = table.take(sorted(range(len(keys)), key=lambda i: (order[keys[i][0]], keys[i][1])))
        sums = [read_manifest(p.uri)[0].summary for p in parts]
        versions = version_summary(inp.rollout)
        for p, s in zip(parts, sums):
            if s.get("policy_version", versions["policy_version"]) != versions["policy_version"]:
                raise ValueError(f"rollout shard {p.uri} was sampled with policy version {s['policy_version']}, "
                                 f"the merged rollout with {versions['policy_version']}: shards of another rollout")
        n_tokens = sum(s["generated_tokens"] for s in sums)
        seconds = max(s["seconds"] for s in sums)  # the shards ran in parallel
        agent = inp.rollout.rollout.agent
        summary = {"seconds": seconds, "generated_tokens": n_tokens, "tokens_per_second": n_tokens / max(seconds, 1e-9),
                   **({"environment": agent.environment} if agent is not None else {}),
                   **rollout_summary(table, agent=agent is not None), **versions, "shards": len(parts)}
        return commit.write(table, schema=ROLLOUT, summary=summary,
                            inputs={**rollout_inputs(inp.rollout), **{f"shard{i}": p for i, p in enumerate(parts)}})

    return reuse_or_compute(commit, compute)
