"""Critic stages: values of the rollout's responses, and the critic update on the returns."""
from __future__ import annotations

import pyarrow as pa

from rft_core.config import CriticConfig
from rft_core.models.critic import batched_response_values, load_critic
from rft_core.models.loading import load_tokenizer
from rft_core.stages.common import (
    CRITIC_SUBDIR,
    PolicyRef,
    Timer,
    commit_checkpoint,
    policy_checkpoint_dir,
    policy_model_path,
    reuse_or_compute,
)
from rft_core.training.critic import CriticData, critic_update
from rft_core.training.update import load_optimizer_state, make_optimizer
from schemas import ShardRef, config_hash, read_shard, write_shard
from schemas.columns import CRITIC_UPDATE, CRITIC_VALUES
from schemas.experience import align_on_sample_id


def critic_model_path(critic: PolicyRef) -> str:
    """Loadable path of a critic: an initial model path, or a committed critic_update stage."""
    return policy_model_path(critic, CRITIC_SUBDIR)


def run_values(rollout: ShardRef, critic: PolicyRef, cfg: CriticConfig, *, out: str) -> ShardRef:
    """V(s_t) for every response token; writes the `critic_values` column group."""
    chash = config_hash("critic_values", cfg.micro_batch_size, cfg.dtype, rollout, critic)

    def compute() -> ShardRef:
        table = read_shard(rollout, stage="rollout")
        path = critic_model_path(critic)
        tok = load_tokenizer(path)
        model = load_critic(path, dtype=cfg.dtype)
        with Timer() as t:
            values = batched_response_values(model, table.column("prompt_token_ids").to_pylist(),
                                             table.column("response_token_ids").to_pylist(),
                                             pad_token_id=tok.pad_token_id, micro_batch_size=cfg.micro_batch_size)
        out_table = pa.table({"sample_id": table.column("sample_id"), "values": pa.array(values, pa.list_(pa.float32()))},
                             schema=CRITIC_VALUES.arrow)
        flat = [v for row in values for v in row]
        return write_shard(out_table, out, schema=CRITIC_VALUES, config_hash=chash, inputs={"rollout": rollout},
                           summary={"seconds": t.seconds, "value_mean": sum(flat) / max(len(flat), 1)})

    return reuse_or_compute("critic_values", out, chash, compute)


def run_update(rollout: ShardRef, advantages: ShardRef, values: ShardRef, critic: PolicyRef, cfg: CriticConfig, *,
               out: str) -> ShardRef:
    """Train the critic on the advantage stage's returns; commits metrics + ``critic/`` checkpoint."""
    chash = config_hash("critic_update", cfg, rollout, advantages, values, critic)

    def compute() -> ShardRef:
        r = read_shard(rollout, stage="rollout")
        a = align_on_sample_id(r, read_shard(advantages, stage="advantages"), name="advantages")
        v = align_on_sample_id(r, read_shard(values, stage="critic_values"), name="critic_values")
        data = CriticData(r.column("prompt_token_ids").to_pylist(), r.column("response_token_ids").to_pylist(),
                          v.column("values").to_pylist(), a.column("returns").to_pylist())
        path = critic_model_path(critic)
        tok = load_tokenizer(path)
        model = load_critic(path, dtype=cfg.dtype, trainable=True)
        opt = make_optimizer(model, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        load_optimizer_state(opt, policy_checkpoint_dir(critic, CRITIC_SUBDIR), lr=cfg.lr)
        with Timer() as t:
            steps = critic_update(model, opt, data, pad_token_id=tok.pad_token_id, value_loss=cfg.value_loss,
                                  value_clip=cfg.value_clip, loss_agg=cfg.loss_agg, epochs=cfg.epochs,
                                  train_batch_size=cfg.train_batch_size, micro_batch_size=cfg.micro_batch_size,
                                  max_grad_norm=cfg.max_grad_norm, seed=cfg.seed)
        summary = {"seconds": t.seconds, "value_loss": sum(s.value_loss for s in steps) / len(steps),
                   "value_clip_frac": sum(s.value_clip_frac for s in steps) / len(steps)}
        inputs = {"rollout": rollout, "advantages": advantages, "critic_values": values,
                  **({"critic": critic} if isinstance(critic, ShardRef) else {})}
        return commit_checkpoint(out, subdir=CRITIC_SUBDIR, model=model, tokenizer=tok, optimizer=opt, steps=steps,
                                 schema=CRITIC_UPDATE, config_hash=chash, inputs=inputs, summary=summary)

    return reuse_or_compute("critic_update", out, chash, compute)
