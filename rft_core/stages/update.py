"""PPO update stage: train the policy on the iteration's experience; commit metrics + checkpoint."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import fsspec

from rft_core.config import KLConfig, UpdateConfig, policy_loss_kwargs
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import default_device
from rft_core.models.lora import adapter_base_path, apply_lora, is_adapter_dir, load_adapter_policy
from rft_core.models.vl import vl_processor_or_none
from rft_core.progress import progress_reporter
from rft_core.stages.common import (
    POLICY_SUBDIR,
    PolicyRef,
    Timer,
    commit_checkpoint,
    policy_checkpoint_dir,
    policy_model_path,
)
from rft_core.stages.optimizer_state import (
    commit_optimizer_state,
    optimizer_state_dir,
    optimizer_state_missing,
    optimizer_state_ref,
)
from rft_core.stages.retention import WEIGHT_SUFFIXES
from rft_core.training.strategy import DeepSpeedStrategy
from rft_core.training.update import UpdateData, load_optimizer_state, make_optimizer, ppo_update
from schemas import ShardRef, committed_ref, config_hash, read_manifest, read_shard
from schemas.columns import PPO_UPDATE
from schemas.shards import _sha256_file
from schemas.experience import align_on_sample_id


log = logging.getLogger("rft_core.stages")


class _WithStateDict:
    """``model`` whose ``save_pretrained`` writes ``state_dict`` (weights gathered from ZeRO ranks)."""

    def __init__(self, model, state_dict) -> None:
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, out, **kw) -> None:
        self.model.save_pretrained(out, state_dict=self.state_dict, **kw)


# UpdateConfig fields added after runs were committed: left out of the config hash while they
# hold their defaults, so older runs still resume.
_HASH_OPTIONAL = {"lora": None, "packing": False, "deepspeed": None}


def update_hash_view(cfg: UpdateConfig) -> dict:
    """The part of ``cfg`` that enters the ppo_update config hash."""
    return cfg.model_dump(mode="json", exclude={k for k, v in _HASH_OPTIONAL.items() if getattr(cfg, k) == v})


def load_trainable_policy(policy: PolicyRef, cfg: UpdateConfig, *, dtype: str):
    """The policy to train: full weights, or with ``cfg.lora`` a peft LoRA model whose adapters
    are the only trainable parameters (new adapters on a plain model, or the previous
    iteration's adapter checkpoint continued).

    Raises:
        ValueError: a LoRA checkpoint without ``cfg.lora``, or one of another rank.
    """
    path = policy_model_path(policy)
    if is_adapter_dir(path):
        if cfg.lora is None:
            raise ValueError(f"policy {path} is a LoRA adapter checkpoint but update.lora is not set")
        model = load_adapter_policy(path, dtype=dtype, trainable=True)
        rank = model.peft_config["default"].r
        if rank != cfg.lora.rank:
            raise ValueError(f"policy {path} has LoRA rank {rank} but update.lora.rank is {cfg.lora.rank}")
        base = adapter_base_path(path)
    else:
        model = load_causal_lm(path, dtype=dtype, trainable=True)
        base = path
    if cfg.lora is not None and not is_adapter_dir(path):
        model = apply_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                           target_modules=cfg.lora.target_modules, base_path=base)
    if cfg.gradient_checkpointing:
        # non-reentrant checkpointing needs no input that requires grad (frozen LoRA base)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _weights_match(model, update: ShardRef) -> bool:
    """Whether ``model`` saved now gives the weight files (same names, same sha256) that the
    committed ``update`` lists under ``policy/``."""
    manifest, _ = read_manifest(update.uri)
    want = {e.path.rpartition("/")[2]: e.sha256 for e in manifest.files
            if e.path.startswith(f"{POLICY_SUBDIR}/") and e.path.endswith(WEIGHT_SUFFIXES)}
    with tempfile.TemporaryDirectory(prefix="rft-recheck-") as tmp:
        model.save_pretrained(tmp)
        fs = fsspec.filesystem("file")
        got = {p.name: _sha256_file(fs, str(p))[1] for p in Path(tmp).iterdir() if p.name.endswith(WEIGHT_SUFFIXES)}
    return bool(want) and got == want


def run(rollout: ShardRef, advantages: ShardRef, *, actor: ShardRef | None, ref: ShardRef | None, policy: PolicyRef,
        cfg: UpdateConfig, kl_cfg: KLConfig, temperature: float, out: str, dtype: str = "float32",
        background_optimizer: bool = False) -> ShardRef:
    """Update ``policy`` and commit ``out`` = per-step metrics parts + ``policy/`` HF checkpoint
    (a peft adapter folder with ``cfg.lora``), then the AdamW state as the sibling optimizer
    stage ``{out}-optimizer`` (``rft_core.stages.optimizer_state``).

    The optimizer state of the previous checkpoint (if ``policy`` is one) is restored, with the
    configured learning rate; its stage's checksum enters the config hash.
    ``background_optimizer``: write the new optimizer state in a background thread (it then
    overlaps the next stages; the next ppo_update waits for it) instead of before returning.

    A committed ``out`` is reused; if its optimizer stage is missing (a background write lost
    to a crash), the update is recomputed from the same committed inputs and seeds, the new
    weights are checked against the committed checksums (a mismatch, possible with
    nondeterministic GPU kernels, is logged) and only the optimizer stage is committed.

    Raises:
        OptimizerStateError: the optimizer state of ``policy`` is missing.
        CheckpointPrunedError: the checkpoint ``policy`` or its optimizer state was pruned.
    """
    use_kl_loss = kl_cfg.mode == "loss" and kl_cfg.kl_coef > 0
    opt_ref = optimizer_state_ref(policy) if cfg.deepspeed is None else None
    # (runs of the older layout, optimizer state inside the checkpoint: no opt_ref, hash unchanged)
    chash = config_hash("ppo_update", update_hash_view(cfg), kl_cfg, rollout, advantages, actor, ref if use_kl_loss else None, policy,
                        temperature, dtype, *([opt_ref] if opt_ref is not None else []))

    def compute(recover: ShardRef | None = None) -> ShardRef:
        r = read_shard(rollout, stage="rollout")
        a = align_on_sample_id(r, read_shard(advantages, stage="advantages"), name="advantages")
        actor_t = align_on_sample_id(r, read_shard(actor, stage="actor_logprobs"), name="actor_logprobs") if actor else None
        old = actor_t.column("old_logprobs") if actor_t is not None else r.column("rollout_logprobs")
        ref_lp = None
        if use_kl_loss:
            if ref is None:
                raise ValueError("kl.mode='loss' with kl_coef > 0 needs the ref_logprobs stage")
            ref_lp = align_on_sample_id(r, read_shard(ref, stage="ref_logprobs"), name="ref_logprobs").column("ref_logprobs").to_pylist()
        data = UpdateData(prompts=r.column("prompt_token_ids").to_pylist(), responses=r.column("response_token_ids").to_pylist(),
                          old_logprobs=old.to_pylist(), advantages=a.column("advantages").to_pylist(), ref_logprobs=ref_lp,
                          entropies=actor_t.column("action_entropy").to_pylist() if actor_t is not None else None,
                          images=r.column("images").to_pylist())
        path = policy_model_path(policy)
        processor = vl_processor_or_none(path)
        tok = load_tokenizer(path)
        model = load_trainable_policy(policy, cfg, dtype=dtype)
        strategy, opt = None, None
        if cfg.deepspeed is not None:
            ds = cfg.deepspeed
            strategy = DeepSpeedStrategy(model, zero_stage=ds.zero_stage, lr=cfg.lr, betas=cfg.betas,
                                         weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                                         offload_optimizer=ds.offload_optimizer, torch_adam=ds.torch_adam)
            if policy_checkpoint_dir(policy) is not None:
                log.warning("ppo_update: DeepSpeed starts AdamW afresh (optimizer state is not carried across "
                            "iterations under ZeRO)")
        else:
            model.to(default_device())  # (DeepSpeed places the model on its rank's device itself)
            opt = make_optimizer(model, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
            load_optimizer_state(opt, optimizer_state_dir(opt_ref) if opt_ref is not None else policy_checkpoint_dir(policy),
                                 lr=cfg.lr)
        rank = strategy.rank if strategy is not None else 0
        with Timer() as t, progress_reporter("ppo_update", unit="optimizer steps", use_bar=None if rank == 0 else False,
                                             log_fn=None if rank == 0 else (lambda line: None)) as progress:
            steps = ppo_update(model, opt, data, pad_token_id=tok.pad_token_id, policy_loss=cfg.policy_loss.name,
                               policy_loss_kwargs=policy_loss_kwargs(cfg.policy_loss), loss_agg=cfg.loss_agg,
                               loss_norm_tokens=cfg.loss_norm_tokens, entropy_coef=cfg.entropy_coef,
                               entropy_top_fraction=cfg.entropy_top_fraction,
                               kl_coef=kl_cfg.kl_coef if use_kl_loss else 0.0, kl_estimator=kl_cfg.estimator,
                               kl_clamp=kl_cfg.kl_clamp, epochs=cfg.epochs, train_batch_size=cfg.train_batch_size,
                               micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                               temperature=temperature, seed=cfg.seed, packing=cfg.packing, progress=progress,
                               strategy=strategy, processor=processor)
        last = steps[-1]
        summary = {"seconds": t.seconds, "policy_loss": sum(s.policy_loss for s in steps) / len(steps),
                   "clip_frac": sum(s.clip_frac for s in steps) / len(steps), "approx_kl": last.approx_kl,
                   "grad_norm": last.grad_norm, "kl_loss": last.kl_loss, "optimizer_steps": len(steps)}
        inputs = {"rollout": rollout, "advantages": advantages, **({"actor": actor} if actor else {}),
                  **({"ref": ref} if ref and use_kl_loss else {}), **({"policy": policy} if isinstance(policy, ShardRef) else {}),
                  **({"optimizer": opt_ref} if opt_ref is not None else {})}
        if strategy is None and recover is not None:
            match = _weights_match(model, recover)
            if match:
                log.info("ppo_update: recomputed the lost optimizer state of %s (weights match the commit)", recover.uri)
            else:
                log.warning("ppo_update: recomputed the lost optimizer state of %s, but the recomputed weights differ "
                            "from the committed ones (nondeterministic kernels?); training goes on with it", recover.uri)
            commit_optimizer_state(recover, opt.state_dict(), background=False,
                                   summary={"recovered": True, "weights_match": match})
            return recover
        if strategy is None:
            new = commit_checkpoint(out, subdir=POLICY_SUBDIR, model=model, tokenizer=processor or tok, optimizer=None, steps=steps,
                                    schema=PPO_UPDATE, config_hash=chash, inputs=inputs, summary=summary)
            commit_optimizer_state(new, opt.state_dict(), background=background_optimizer)
            return new
        # DeepSpeed: gather the weights on every rank (a collective), rank 0 commits, the others
        # wait for the commit and return the same ref
        state = strategy.full_state_dict()
        ref_out = None
        if strategy.rank == 0:
            summary.update({"world_size": strategy.world_size, "zero_stage": strategy.zero_stage})
            ref_out = commit_checkpoint(out, subdir=POLICY_SUBDIR, model=_WithStateDict(model, state), tokenizer=processor or tok,
                                        optimizer=None, steps=steps, schema=PPO_UPDATE, config_hash=chash, inputs=inputs,
                                        summary=summary)
        strategy.barrier()
        return ref_out if ref_out is not None else committed_ref(out, stage="ppo_update", config_hash=chash)

    done = committed_ref(out, stage="ppo_update", config_hash=chash)
    if done is None:
        return compute()
    log.info("ppo_update: reusing committed shard %s (config %s)", out, chash)
    if cfg.deepspeed is None and optimizer_state_missing(done):
        log.warning("ppo_update: %s has no committed optimizer state (its background write was lost); recomputing it", out)
        compute(recover=done)
    return done
