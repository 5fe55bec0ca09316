"""Critic stages: values of the rollout's responses, and the critic update on the returns."""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from rft_core.config import CriticConfig
from rft_core.models.critic import batched_response_values, load_critic
from rft_core.models.loading import leased_tokenizer, pad_token_id
from rft_core.models.vl import VLProcessor, vl_processor_or_none
from rft_core.progress import progress_reporter
from rft_core.stages.checkpoints import CRITIC_SUBDIR, policy_checkpoint_dir, policy_model_path, sharded_state_dir
from rft_core.stages.common import Commit, Timer, commit_trained, reuse_or_compute, stage_commit
from rft_core.stages.contracts import CriticUpdateInput, CriticValuesInput, stage_program
from rft_core.stages.sharded_state import DEEPSPEED_FORMAT, FSDP_FORMAT, check_kind, continued_state
from rft_core.stages.sources import critic_model, critic_strategy, critic_trained
from rft_core.training.critic import CriticData, critic_update
from rft_core.training.loop import pass_micro_batches
from rft_core.training.strategy import DeepSpeedStateError, OptimizerSettings, build_strategy, weights_on_rank0
from schemas import PolicyRef, ShardRef, read_manifest, read_shard
from schemas.batch import align_on_sample_id
from schemas.columns import CRITIC_UPDATE, CRITIC_VALUES


def critic_model_path(critic: PolicyRef) -> str:
    """Loadable path of a critic: an initial model path, or a committed critic_update stage."""
    return policy_model_path(critic, CRITIC_SUBDIR)


def _vision(path: str, rollout: pa.Table) -> tuple[VLProcessor | None, dict[str, list]]:
    """(the critic's ``VLProcessor``, {images, videos} of the rollout rows) for a
    vision-language critic at ``path``; (None, {}) for a text critic."""
    processor = vl_processor_or_none(path)
    if processor is None:
        return None, {}
    return processor, {"images": rollout.column("images").to_pylist(), "videos": rollout.column("videos").to_pylist()}


def _critic_commit(inp: CriticValuesInput | CriticUpdateInput) -> Commit:
    """The stage's ``Commit``; with ``critic.packing`` its config hash also holds
    ``packed_sequences="separate"``: before 2026-12-01 a text critic's forward kept a KV cache,
    with which transformers reads a packed row as one sequence (each attended to those before it in
    its row), so critic stages committed then with packing are stale, not reused; without
    packing the hash is what it was. A DeepSpeed or FSDP2 ``critic_update``'s also holds
    ``sharded_optimizer="continued"``: before 2026-12-01 (second session) it started AdamW afresh
    each update and kept no state for the next, so those stages are stale too."""
    sharded = isinstance(inp, CriticUpdateInput) and inp.critic.sharded
    return stage_commit(inp, packed_sequences="separate" if inp.critic.packing else None,
                        sharded_optimizer="continued" if sharded else None)


def _saved_state(critic: PolicyRef, cfg: CriticConfig) -> dict[str, Any]:
    """The keyword arguments of ``build_strategy`` that continue the AdamW state of the critic
    ``critic``: none for an initial critic (a path: AdamW afresh); ``optimizer_state``, the folder
    of a single-process critic's ``critic/optimizer.pt``; ``deepspeed_state`` or ``fsdp_state``
    for a DeepSpeed or FSDP2 critic's ``critic-optimizer/`` (``rft_core.stages.sharded_state``,
    resolved once per node: a collective over the update's ranks). An FSDP2 state continues on any
    number of ranks; a DeepSpeed one on the same world size, ZeRO stage and dtype
    (``check_deepspeed_state``).

    Raises:
        DeepSpeedStateError: the state was written by another kind of update than ``cfg``'s
            (critic.deepspeed or critic.fsdp changed within a run), or by a sharded critic update
            that kept none (committed before the state was kept).
    """
    if not isinstance(critic, ShardRef):
        return {}
    summary = read_manifest(critic.uri)[0].summary
    info = summary.get("optimizer")
    if info is None and "world_size" in summary:
        raise DeepSpeedStateError(f"{critic.uri}: this sharded critic update kept no optimizer state (committed before "
                                  "a DeepSpeed or FSDP2 critic's AdamW state was kept, 2026-12-01): start a new run, "
                                  "or train the critic from its weights with critic.model.path")
    now = FSDP_FORMAT if cfg.fsdp is not None else DEEPSPEED_FORMAT if cfg.deepspeed is not None else None
    check_kind(info, now, source=critic.uri, keys="critic.deepspeed and critic.fsdp")
    if info is None:
        return {"optimizer_state": policy_checkpoint_dir(critic, CRITIC_SUBDIR)}
    saved = continued_state(info, lambda: sharded_state_dir(critic, CRITIC_SUBDIR), source=critic.uri, role="critic")
    return {"fsdp_state": saved} if now == FSDP_FORMAT else {"deepspeed_state": saved}


@stage_program(CriticValuesInput)
def run_values(inp: CriticValuesInput) -> ShardRef | None:
    """V(s_t) for every response token under the critic ``inp.model``, on ``default_device()``, in
    packed rows of at most ``critic.max_tokens_per_micro_batch`` tokens when it is set;
    writes the `critic_values` column group (GPU memory handed back when it returns). A
    vision-language critic (``rft_core.models.critic.VLValueModel``) gets each sample's images
    and videos, with the processor of its model folder. In the resident gang of a sharded
    critic (``orchestration.critic_ranks``) rank 0 computes and commits it alone, on the critic
    loaded from storage (``rft_core.workers.critic``); the other ranks return None."""
    commit = _critic_commit(inp)
    cfg = inp.critic

    def compute() -> ShardRef | None:
        table = read_shard(inp.rollout, stage="rollout")
        prompts, responses = table.column("prompt_token_ids").to_pylist(), table.column("response_token_ids").to_pylist()
        budget = cfg.max_tokens_per_micro_batch  # a sample beyond it: refused before the model loads
        groups = None if budget is None else pass_micro_batches(prompts, responses, budget,
                                                                  key="critic.max_tokens_per_micro_batch")
        model = critic_model(inp.model, dtype=cfg.dtype)
        if model is None:  # a rank above 0 of a sharded critic's gang: rank 0 computes alone
            return None
        path = critic_model_path(inp.model)
        processor, media = _vision(path, table)
        pad_id = pad_token_id(path)
        with Timer() as t, progress_reporter("critic_values", unit="sequences") as progress:
            values = batched_response_values(model, prompts, responses, pad_token_id=pad_id,
                                             micro_batch_size=cfg.micro_batch_size, packing=cfg.packing,
                                             processor=processor, progress=progress, groups=groups, **media)
        out_table = pa.table({"sample_id": table.column("sample_id"), "values": pa.array(values, pa.list_(pa.float32()))},
                             schema=CRITIC_VALUES.arrow)
        flat = [v for row in values for v in row]
        return commit.write(out_table, schema=CRITIC_VALUES, inputs={"rollout": inp.rollout},
                            summary={"seconds": t.seconds, "value_mean": sum(flat) / max(len(flat), 1)})

    return reuse_or_compute(commit, compute)


@stage_program(CriticUpdateInput)
def run_update(inp: CriticUpdateInput) -> ShardRef:
    """Train the critic on the advantage stage's returns with the shared training loop (one
    process on ``default_device()``, or DeepSpeed ZeRO with ``critic.deepspeed``, or FSDP2 with
    ``critic.fsdp``, under torchrun), continuing the previous critic's AdamW state
    (``_saved_state``; a sharded one's float32 masters too),
    on the tokens the policy sampled (the rollout's ``action_mask``: not on a multi-turn
    response's observation tokens);
    commits metrics + the ``critic/`` checkpoint with its AdamW state (``critic/optimizer.pt`` in
    one process; every rank's part in ``critic-optimizer/`` under DeepSpeed or FSDP2). A critic in
    bfloat16 (``critic.model.dtype``) trains in mixed precision: float32 master weights and AdamW
    state (kept in ``critic/optimizer.pt`` for the next update; a sharded critic's in
    ``critic-optimizer/``), bfloat16 autocast, and the
    checkpoint's weights in bfloat16 (``rft_core.training.strategy.build_strategy``). A
    vision-language critic trains on the samples' images and videos and its checkpoint keeps
    the processor (tokenizer, image processor, video settings), so it loads again as one."""
    commit = _critic_commit(inp)
    cfg = inp.critic

    def compute() -> ShardRef:
        r = read_shard(inp.rollout, stage="rollout")
        a = align_on_sample_id(r, read_shard(inp.advantages, stage="advantages"), name="advantages")
        v = align_on_sample_id(r, read_shard(inp.critic_values, stage="critic_values"), name="critic_values")
        with weights_on_rank0(cfg.fsdp is not None):  # FSDP2: the other ranks read no model weights
            path = critic_model_path(inp.model)
            processor, media = _vision(path, r)
        data = CriticData(r.column("prompt_token_ids").to_pylist(), r.column("response_token_ids").to_pylist(),
                          v.column("values").to_pylist(), a.column("returns").to_pylist(), **media,
                          action_masks=r.column("action_mask").to_pylist())
        pad_id = pad_token_id(path)

        def build():
            saved = _saved_state(inp.model, cfg)
            with weights_on_rank0(cfg.fsdp is not None):
                model = load_critic(path, dtype=cfg.dtype, trainable=True)
            return build_strategy(model, optim=OptimizerSettings.of(cfg), deepspeed=cfg.deepspeed, fsdp=cfg.fsdp,
                                  compute_dtype=cfg.dtype, keeps_deepspeed_state=True, **saved)

        strategy = critic_strategy(inp.model, build, lr=cfg.lr, max_grad_norm=cfg.max_grad_norm)
        quiet = strategy.rank != 0
        with Timer() as t, progress_reporter("critic_update", unit="micro-batches", use_bar=False if quiet else None,
                                             log_fn=(lambda line: None) if quiet else None) as progress:
            steps = critic_update(strategy, data, cfg, pad_token_id=pad_id, processor=processor,
                                  progress=progress)
        summary = {"seconds": t.seconds, "value_loss": sum(s.value_loss for s in steps) / len(steps),
                   "value_clip_frac": sum(s.value_clip_frac for s in steps) / len(steps)}
        inputs = {"rollout": inp.rollout, "advantages": inp.advantages, "critic_values": inp.critic_values,
                  **({"critic": inp.model} if isinstance(inp.model, ShardRef) else {})}
        with leased_tokenizer(path) as tok:  # saved beside the weights
            new = commit_trained(commit, strategy, subdir=CRITIC_SUBDIR, tokenizer=processor or tok, steps=steps,
                                 schema=CRITIC_UPDATE, inputs=inputs, summary=summary, keep_optimizer=True)
        critic_trained(new)
        return new

    return reuse_or_compute(commit, compute)
