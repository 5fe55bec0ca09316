"""PPO update stage: train the policy on the iteration's experience; commit metrics + checkpoint."""
from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from rft_core.config import UpdateConfig
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.lora import adapted_modules_differ, adapter_base_path, apply_lora, is_adapter_dir
from rft_core.models.vl import vl_processor_or_none
from rft_core.progress import progress_reporter
from rft_core.stages.advantages import overlong_filtered
from rft_core.stages.checkpoints import POLICY_SUBDIR, check_policy_weights, policy_model_path
from rft_core.stages.common import Commit, Timer, commit_trained, stage_commit
from rft_core.stages.contracts import PPOUpdateInput, stage_program
from rft_core.stages.lineage import (
    UPDATE_INPUT_KEY,
    WEIGHTS_DIGEST_KEY,
    has_weights,
    kept_in_memory,
    policy_checkpoint_uri,
    trained_digest,
    update_input_of,
)
from rft_core.stages.optimizer_state import (
    commit_optimizer_state,
    commit_policy_checkpoint,
    commit_sharded_optimizer_state,
    optimizer_state_committed,
    optimizer_state_key,
    optimizer_state_missing,
    optimizer_state_ref,
    recover_deepspeed_optimizer_state,
    saved_optimizer_state,
    wait_for_writes_of,
    writes_reading_tensors,
)
from rft_core.stages.writer import OptimizerStateError, wait_for_optimizer_writes
from rft_core.stages.retention import WEIGHT_SUFFIXES
from rft_core.training.strategy import (
    DeepSpeedStrategy,
    FSDPCheckpoint,
    FSDPStrategy,
    OptimizerSettings,
    SingleProcess,
    build_strategy,
    continue_with,
    weights_on_rank0,
)
from rft_core.training.update import (
    SampleCorrection,
    StepMetrics,
    UpdateData,
    UpdateSettings,
    ppo_update,
    rollout_correction_weights,
)
import rft_core.stages.memo as memo
from rft_core.stages.sources import current_source, version_key
from schemas import PolicyRef, ShardRef, file_checksum, read_manifest, read_shard
from schemas.batch import align_on_sample_id
from schemas.columns import PPO_UPDATE, token_versions_of
from schemas.storage import CHECKSUM, checksum_algorithm

log = logging.getLogger("rft_core.stages")


def load_trainable_policy(policy: PolicyRef, cfg: UpdateConfig, *, dtype: str):
    """The policy to train: full weights, or with ``cfg.lora`` a peft LoRA model whose adapters
    are the only trainable parameters (new adapters on a plain model, or the previous
    iteration's adapter checkpoint continued).

    Raises:
        ValueError: a LoRA checkpoint without ``cfg.lora``, or one of another rank, alpha or target
            modules (``adapted_modules_differ``), or
            with rsLoRA or per-module ranks/alphas (it keeps the scaling it was trained with,
            which every copy of it applies: stage mode's from its adapter_config.json, a resident
            engine's from ``update.lora``, which holds a plain rank and alpha only).
    """
    path = policy_model_path(policy)
    if is_adapter_dir(path):
        if cfg.lora is None:
            raise ValueError(f"policy {path} is a LoRA adapter checkpoint but update.lora is not set")
        model = load_causal_lm(path, dtype=dtype, trainable=True, merge_adapter=False)  # counted as a model load
        saved = model.peft_config["default"]
        rank, alpha = saved.r, saved.lora_alpha
        if saved.use_rslora or saved.rank_pattern or saved.alpha_pattern:
            raise ValueError(f"policy {path} is a LoRA adapter with use_rslora, rank_pattern or alpha_pattern, which "
                             "update.lora cannot express (its config hash and a resident engine's copy would miss "
                             "them): continue it with peft directly, or start from a plain rank/alpha adapter")
        if rank != cfg.lora.rank:
            raise ValueError(f"policy {path} has LoRA rank {rank} but update.lora.rank is {cfg.lora.rank}")
        if alpha != cfg.lora.alpha:
            raise ValueError(f"policy {path} has LoRA alpha {alpha} but update.lora.alpha is {cfg.lora.alpha}: set "
                             f"update.lora.alpha: {alpha} (the adapter was trained with that scaling)")
        differ = adapted_modules_differ(model, cfg.lora.target_modules)
        if differ:
            raise ValueError(f"policy {path} is a LoRA adapter on other modules than update.lora asks for: {differ}; "
                             "set update.lora.target_modules to the adapter's (its adapter_config.json)")
        base = adapter_base_path(path)
    else:
        model = load_causal_lm(path, dtype=dtype, trainable=True)
        base = path
    if cfg.lora is not None and not is_adapter_dir(path):
        model = apply_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                           target_modules=cfg.lora.target_modules, base_path=base, seed=cfg.seed)
    if cfg.gradient_checkpointing:
        # non-reentrant checkpointing needs no input that requires grad (frozen LoRA base)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _weights_match(model, update: ShardRef) -> bool:
    """Whether ``model`` saved now gives the weight files (same names, same checksums, in the
    algorithm the manifest recorded) that the committed ``update`` lists under ``policy/``."""
    manifest, _ = read_manifest(update.uri)
    want = {e.path.rpartition("/")[2]: e.checksum for e in manifest.files
            if e.path.startswith(f"{POLICY_SUBDIR}/") and e.path.endswith(WEIGHT_SUFFIXES)}
    with tempfile.TemporaryDirectory(prefix="rft-recheck-") as tmp:
        model.save_pretrained(tmp)
        fs = fsspec.filesystem("file")
        algorithm = checksum_algorithm(next(iter(want.values()))) if want else CHECKSUM  # one per manifest
        got = {p.name: file_checksum(fs, str(p), algorithm)[1]
               for p in Path(tmp).iterdir() if p.name.endswith(WEIGHT_SUFFIXES)}
    return bool(want) and got == want


def update_data(inp: PPOUpdateInput) -> UpdateData:
    """What the update trains on, read from the committed shards in rollout order: old
    log-probs from the actor stage (the rollout engine's without one) and the engine's own
    (``rollout_logprobs``, for the rollout correction), ref log-probs when the KL is a loss term,
    the actor stage's entropies, the prompts' images and videos, the rollout's ``action_mask``
    (only the tokens the policy sampled count: not a multi-turn response's observation tokens)
    and the rows out of the loss (the truncated responses when the advantages stage filtered
    them, ``overlong_filtered``).

    Raises:
        ValueError: the KL is a loss term but ``inp.ref_logprobs`` is None, or the rollout
            correction is on without the actor stage's old log-probs.
    """
    r = read_shard(inp.rollout, stage="rollout")
    a = align_on_sample_id(r, read_shard(inp.advantages, stage="advantages"), name="advantages")
    actor = (align_on_sample_id(r, read_shard(inp.actor_logprobs, stage="actor_logprobs"), name="actor_logprobs")
             if inp.actor_logprobs else None)
    if inp.update.rollout_correction.enabled and actor is None:
        raise ValueError("update.rollout_correction needs the trainer's old log-probs (the actor_logprobs stage, "
                         "logprobs.recompute_old_logprobs=true): with the engine's as old log-probs every weight is 1")
    old = actor.column("old_logprobs") if actor is not None else r.column("rollout_logprobs")
    ref_lp = None
    if inp.kl.in_loss:
        if inp.ref_logprobs is None:
            raise ValueError("kl.mode='loss' with kl_coef > 0 needs the ref_logprobs stage")
        ref_lp = align_on_sample_id(r, read_shard(inp.ref_logprobs, stage="ref_logprobs"),
                                    name="ref_logprobs").column("ref_logprobs").to_pylist()
    excluded = ([f == "length" for f in r.column("finish_reason").to_pylist()] if overlong_filtered(inp.advantages)
                else None)
    return UpdateData(prompts=r.column("prompt_token_ids").to_pylist(), responses=r.column("response_token_ids").to_pylist(),
                      old_logprobs=old.to_pylist(), advantages=a.column("advantages").to_pylist(), ref_logprobs=ref_lp,
                      entropies=actor.column("action_entropy").to_pylist() if actor is not None else None,
                      images=r.column("images").to_pylist(), videos=r.column("videos").to_pylist(),
                      rollout_logprobs=r.column("rollout_logprobs").to_pylist() if actor is not None else None,
                      excluded=excluded, action_masks=r.column("action_mask").to_pylist())


def update_correction(cfg: UpdateConfig, data: UpdateData) -> tuple[SampleCorrection | None, dict[str, float]]:
    """The rollout correction when ``cfg.rollout_correction.enabled`` (and its metrics); without
    it, only ``rollout_kl`` (the mismatch KL(pi_rollout || pi_old)) when the actor stage ran."""
    rc = cfg.rollout_correction
    if data.rollout_logprobs is None or len(data) == 0:
        return None, {}
    corr = rollout_correction_weights(data, **rc.correction_kwargs())
    if not rc.enabled:
        return None, {"rollout_kl": corr.metrics["rollout_kl"]}
    return corr, corr.metrics


@dataclass
class PolicyTrainer:
    """The policy being trained: its strategy (the model and its AdamW state), its tokenizer
    and, for a vision-language policy, its processor (None for text). A stage-mode update
    builds one from storage (``build_trainer``) and drops it; a resident worker keeps one
    across iterations (``rft_core.workers.policy.PolicyWorker``)."""

    strategy: SingleProcess | DeepSpeedStrategy | FSDPStrategy
    tokenizer: Any
    processor: Any = None

    @property
    def saver(self) -> Any:
        """What saves next to the weights: the VL processor, else the tokenizer."""
        return self.processor or self.tokenizer


def build_trainer(policy: PolicyRef, cfg: UpdateConfig, *, dtype: str, opt_ref: ShardRef | None) -> PolicyTrainer:
    """Load ``policy`` from storage and build its strategy, AdamW continued from the optimizer
    stage ``opt_ref`` (None: fresh): ``optimizer.pt`` in one process, the ZeRO partitions
    (AdamW moments, float32 masters) under DeepSpeed, the DCP shards under FSDP2 (on any number
    of ranks: resharded) (``saved_optimizer_state``).

    Raises:
        CheckpointPrunedError, ShardCorruptError: the checkpoint's files are gone or damaged.
        WeightlessPolicyError: ``policy`` kept its weights in memory (``checkpoint.every`` > 1).
        DeepSpeedStateError: the state cannot be continued by this update (update.deepspeed,
            update.fsdp, the world size, ZeRO stage or dtype changed; named).
        FSDPStateError: an FSDP2 state of another dtype or of other weights (named).
    """
    opt_dir, sharded = saved_optimizer_state(opt_ref, deepspeed=cfg.deepspeed is not None, fsdp=cfg.fsdp is not None)
    fsdp_state = sharded if isinstance(sharded, FSDPCheckpoint) else None
    with weights_on_rank0(cfg.fsdp is not None):  # FSDP2: the other ranks read no model weights
        path = policy_model_path(policy)
        model = load_trainable_policy(policy, cfg, dtype=dtype)
        tokenizer, processor = load_tokenizer(path), vl_processor_or_none(path)
    strategy = build_strategy(model, optim=OptimizerSettings.of(cfg),
                              deepspeed=cfg.deepspeed, optimizer_state=opt_dir,
                              deepspeed_state=None if fsdp_state is not None else sharded,  # type: ignore[arg-type]
                              keeps_deepspeed_state=True, fsdp=cfg.fsdp, fsdp_state=fsdp_state)
    return PolicyTrainer(strategy, tokenizer, processor)


def configure_trainer(trainer: PolicyTrainer, cfg: UpdateConfig) -> None:
    """Apply this update's learning rate and clipping to a trainer kept from an earlier update,
    as a stage-mode update does when it restores the optimizer state with the configured
    learning rate (the other AdamW settings stay those the state was created with)."""
    continue_with(trainer.strategy, lr=cfg.lr, max_grad_norm=cfg.max_grad_norm)


def update_settings(inp: PPOUpdateInput) -> UpdateSettings:
    """What ``ppo_update`` runs ``inp`` with: its ``update`` and ``kl`` sections, its rollout
    temperature and the policy version it starts from (``policy_version``; None, an update run
    outside a flow: 0), which with ``update.seed`` seeds its micro-batch order and dropout masks."""
    return UpdateSettings(inp.update, inp.kl, temperature=inp.temperature, policy_version=inp.policy_version or 0)


def run_update_steps(trainer: PolicyTrainer, inp: PPOUpdateInput, data: UpdateData,
                     correction: SampleCorrection | None, *, quiet: bool = False) -> tuple[list[StepMetrics], float]:
    """The optimizer steps of the update ``inp`` on ``trainer`` (which holds ``inp.policy``, with
    this update's learning rate), on its ``data`` (``update_data``) with its ``correction``
    (``update_correction``); ``quiet``: no progress lines. (step metrics, seconds); none for an empty
    rollout (``rollout.partial``: no group finished in this iteration), which leaves the weights
    and the AdamW state as they are (the update still commits them as its version)."""
    strategy = trainer.strategy
    if len(data) == 0:  # a partial rollout in which no group finished: the policy stays as it is
        return [], 0.0
    quiet = quiet or strategy.rank != 0
    with Timer() as t, progress_reporter("ppo_update", unit="micro-batches", use_bar=False if quiet else None,
                                         log_fn=(lambda line: None) if quiet else None) as progress:
        steps = ppo_update(strategy, data, update_settings(inp), pad_token_id=trainer.tokenizer.pad_token_id,
                           correction=correction, progress=progress, processor=trainer.processor)
    return steps, t.seconds


def _train(inp: PPOUpdateInput):
    """The policy trainer holding ``inp.policy`` (a resident worker's, the one the previous
    update of this process kept, or loaded from storage with AdamW continued from its optimizer
    stage) and the update run on it: (trainer, step metrics, seconds, extra summary)."""
    cfg = inp.update
    data = update_data(inp)
    correction, corr_metrics = update_correction(cfg, data)
    source = current_source()
    trainer = source.trainer(inp) if source is not None else _stage_trainer(inp)
    steps, seconds = run_update_steps(trainer, inp, data, correction)
    extra = {**corr_metrics, **({"overlong_filtered_frac": sum(data.excluded) / len(data)} if data.excluded else {}),
             **_engine_old_logprobs_gap(steps, data), **_weights_by_staleness(inp, correction)}
    return trainer, steps, seconds, extra


def trainer_settings(inp: PPOUpdateInput) -> str:
    """What a stage-mode trainer is built from besides its policy version: the dtype and the
    ``update`` section without the learning rate and clipping (``configure_trainer`` applies
    those to a kept trainer as a restore from storage does)."""
    return f"{inp.dtype}|{inp.update.model_dump_json(exclude={'lr', 'max_grad_norm'})}"


def _stage_trainer(inp: PPOUpdateInput) -> PolicyTrainer:
    """The trainer of a stage-mode update: the one the previous update of this process kept
    (``rft_core.stages.memo``, stage mode keeping its models: the same tensors the previous update
    wrote to ``inp.policy``'s checkpoint and optimizer stage, or kept in memory only), with this
    update's learning rate and clipping; for a policy kept in memory only that this process lost,
    rebuilt exactly first (``memo.rebuild``); else built from storage (``build_trainer``)."""
    key, settings, in_memory = version_key(inp.policy), trainer_settings(inp), kept_in_memory(inp.policy)
    kept = memo.take_trainer(key, settings)
    if kept is None and in_memory:  # lost (a rerun, a failed update); memo.rebuild does nothing outside keeping_models
        memo.rebuild(inp.policy)
        kept = memo.take_trainer(key, settings)
    if kept is not None:
        if isinstance(inp.policy, ShardRef) and not in_memory:  # (nothing on storage to check for one in memory)
            check_policy_weights(inp.policy)  # as build_trainer's read would (pruned, damaged), without the read
        configure_trainer(kept, inp.update)
        return kept
    return build_trainer(inp.policy, inp.update, dtype=inp.dtype, opt_ref=optimizer_state_ref(inp.policy))


def _weights_by_staleness(inp: PPOUpdateInput, correction: SampleCorrection | None) -> dict[str, float]:
    """A partial rollout's correction by token age: for each staleness d (updates between the
    policy version that sampled a token, ``token_versions``, and the version this update starts
    from, ``inp.policy_version``), ``rollout_is_weight_mean_staleness_<d>``, the mean weight of
    the tokens of that age left in the loss. {} without a correction, a version or a
    ``token_versions`` column (a rollout that was not partial)."""
    if correction is None or inp.policy_version is None:
        return {}
    r = read_shard(inp.rollout, stage="rollout")
    if "token_versions" not in r.column_names:
        return {}
    sums: dict[int, list[float]] = {}
    for versions, w, keep in zip(token_versions_of(r), correction.weights, correction.keep):
        for v, wt, k in zip(versions, w.tolist(), keep.tolist()):
            if k:
                acc = sums.setdefault(inp.policy_version - v, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + wt, acc[1] + 1
    return {f"rollout_is_weight_mean_staleness_{d}": total / n for d, (total, n) in sorted(sums.items())}


ENGINE_GAP_WARN = 1e-6  # approx_kl of the first step above which the engine's log-probs are not pi_old's


def _engine_old_logprobs_gap(steps: list[StepMetrics], data: UpdateData) -> dict[str, float]:
    """Without an actor stage (the engine's log-probs are the old ones), the first optimizer
    step's ``approx_kl``, 0.5 * mean((logp - old_logp)^2) over its tokens before any weight
    changed: the gap between the engine's and the trainer's log-probs of the same weights
    (``old_logprobs_gap_kl``; float32 rounding gives about 1e-12). Above ``ENGINE_GAP_WARN``
    (an RMS gap of about 1.4e-3) it logs a warning to set logprobs.recompute_old_logprobs=true."""
    if data.rollout_logprobs is not None or not steps:
        return {}
    gap = steps[0].approx_kl
    if gap > ENGINE_GAP_WARN:
        log.warning("ppo_update: the rollout's log-probs differ from the policy's own (first-step approx_kl %.3g > "
                    "%.0e): unless these rollouts come from another policy (a replay, update dropout), set "
                    "logprobs.recompute_old_logprobs=true", gap, ENGINE_GAP_WARN)
    return {"old_logprobs_gap_kl": gap}


def _summary(steps: list[StepMetrics], seconds: float, extra: dict[str, float]) -> dict:
    if not steps:  # an empty rollout: no optimizer step, the weights and AdamW state unchanged
        return {"seconds": seconds, "optimizer_steps": 0, **extra}
    last = steps[-1]
    return {"seconds": seconds, "policy_loss": sum(s.policy_loss for s in steps) / len(steps),
            "clip_frac": sum(s.clip_frac for s in steps) / len(steps), "approx_kl": last.approx_kl,
            "grad_norm": last.grad_norm, "kl_loss": last.kl_loss, "cpgd_drift": last.cpgd_drift,
            "optimizer_steps": len(steps), **extra}


def _recover_optimizer_state(strategy: SingleProcess, done: ShardRef) -> None:
    """Commit the optimizer stage of the committed update ``done`` from a recomputation of it,
    checking the recomputed weights against the committed checksums (a mismatch, possible with
    nondeterministic GPU kernels, is logged and training goes on)."""
    match = _weights_match(strategy.model, done)
    if match:
        log.info("ppo_update: recomputed the lost optimizer state of %s (weights match the commit)", done.uri)
    else:
        log.warning("ppo_update: recomputed the lost optimizer state of %s, but the recomputed weights differ "
                    "from the committed ones (nondeterministic kernels?); training goes on with it", done.uri)
    commit_optimizer_state(done, strategy.optimizer.state_dict(), background=False,
                           summary={"recovered": True, "weights_match": match})


@stage_program(PPOUpdateInput)
def run(inp: PPOUpdateInput) -> ShardRef:
    """Update ``inp.policy`` and commit ``inp.out`` = per-step metrics parts + ``policy/`` HF
    checkpoint (a peft adapter folder with ``update.lora``), then the AdamW state as the sibling
    optimizer stage ``{out}-optimizer`` (``rft_core.stages.optimizer_state``).

    The optimizer state of the previous checkpoint (if ``policy`` is one) is restored, with the
    configured learning rate; its stage's config hash enters the config hash
    (``optimizer_state_key``). ``background_optimizer``: write the new optimizer state in a
    background thread (it then overlaps the next stages and, in stage mode, the next update's
    forward and backward passes; that update's first optimizer step waits for it, or, when the
    write reads a host copy of a CUDA state, its commit) instead of before returning. A resident
    update joins its policy's background checkpoint before it starts, and writes it again if that
    write failed (``_write_lost_checkpoint``).

    A committed ``out`` is reused; if its optimizer stage is missing (a background write lost
    to a crash), the update is recomputed from the same committed inputs and seeds, the new
    weights are checked against the committed checksums and only the optimizer stage is
    committed.

    Raises:
        OptimizerStateError: the optimizer state of ``policy`` is missing.
        CheckpointPrunedError: the checkpoint ``policy`` or its optimizer state was pruned.
    """
    source = current_source()
    if not inp.save_checkpoint and source is None and not memo.keeps_models():
        raise ValueError("ppo_update with save_checkpoint=False keeps the new policy in memory only: it runs in a "
                         "resident worker (orchestration.workers=resident) or in a process that keeps its models "
                         "(orchestration.keep_models), not in a stage process of its own")
    if source is not None and isinstance(inp.policy, ShardRef):  # its checkpoint's write failed: write it first
        _write_lost_checkpoint(inp.policy)  # (joins a pending one: a resident run carries on after a failed write)
    commit = stage_commit(inp, optimizer=optimizer_state_key(inp.policy))
    done = commit.committed()
    if done is not None:
        log.info("ppo_update: reusing committed shard %s (config %s)", commit.uri, commit.config_hash)
        if optimizer_state_missing(done):
            log.warning("ppo_update: %s has no committed optimizer state (its write was lost); recomputing it",
                        commit.uri)
            trainer, _, _, _ = _train(inp)
            if isinstance(trainer.strategy, (DeepSpeedStrategy, FSDPStrategy)):
                recover_deepspeed_optimizer_state(trainer.strategy, done, weights_match=_weights_match)
            else:
                _recover_optimizer_state(trainer.strategy, done)
            if source is not None:
                source.trained(done)
        else:
            _write_lost_checkpoint(done)
        return done
    return _commit_update(inp, commit)


def _lost_checkpoint(done: ShardRef) -> PPOUpdateInput | None:
    """The recorded input of the committed ``ppo_update`` ``done`` when it is a checkpoint
    iteration whose background write (``background_checkpoint``) never committed its weights (a
    crash during it, or a failed write); None otherwise. Waits for a pending write of them first."""
    try:
        wait_for_optimizer_writes(policy_checkpoint_uri(done))
    except OptimizerStateError as exc:
        log.warning("%s", exc)
    summary = read_manifest(done.uri)[0].summary
    if WEIGHTS_DIGEST_KEY not in summary or UPDATE_INPUT_KEY not in summary or has_weights(done):
        return None
    recorded = update_input_of(done)
    return recorded if recorded.save_checkpoint and recorded.background_checkpoint else None


def _write_lost_checkpoint(done: ShardRef) -> None:
    """When the committed ``done`` is a checkpoint whose background write was lost
    (``_lost_checkpoint``), rebuild its policy and write its checkpoint again (the optimizer stage
    unless it committed, then the weights), waiting for it, so a run (rerun, or carried on after a
    failed write) ends with every checkpoint it asked for on storage. In a resident worker the
    policy is rebuilt by the worker (the committed updates re-applied from the last checkpoint, each
    checked against its digest); in stage mode by ``_retrain_lost``."""
    source = current_source()
    recorded = _lost_checkpoint(done)
    if recorded is None:
        return
    log.warning("ppo_update: the checkpoint of %s was not written (a crash or a failure during its background write); "
                "rebuilding that policy and writing it again", done.uri)
    digest = read_manifest(done.uri)[0].summary[WEIGHTS_DIGEST_KEY]
    if source is not None:
        trainer, summary = source.trainer(recorded.model_copy(update={"policy": done})), {}
    else:
        trainer, summary = _retrain_lost(recorded, digest)
    if not optimizer_state_committed(done):
        commit_optimizer_state(done, trainer.strategy.optimizer.state_dict(), background=True, summary=summary)
    commit_policy_checkpoint(done, trainer.strategy.model, trainer.saver, digest=digest)
    wait_for_optimizer_writes(policy_checkpoint_uri(done))
    if source is not None:
        source.trained(done)
    else:
        memo.keep_trainer(version_key(done), trainer_settings(recorded), trainer)


def _retrain_lost(recorded: PPOUpdateInput, digest: str) -> tuple[PolicyTrainer, dict]:
    """Stage mode: a trainer holding the weights of the update ``recorded`` (the input its manifest
    records), whose checkpoint's background write was lost: the update run again from the same
    committed inputs and seeds on its policy, loaded from storage (its checkpoint committed before
    this update did), checked against the recorded ``digest`` (by its own method,
    ``trained_digest``). A mismatch, possible with nondeterministic GPU kernels, is logged and
    training goes on with the recomputed weights, as a recomputed optimizer state does
    (``_recover_optimizer_state``). Returns (trainer, the optimizer stage's summary: ``recovered``,
    ``weights_match``)."""
    trainer, _, _, _ = _train(recorded)
    match = trained_digest(trainer.strategy, like=digest) == digest
    if match:
        log.info("ppo_update: recomputed the lost checkpoint of %s (weights match the recorded digest)", recorded.out)
    else:
        log.warning("ppo_update: recomputed the lost checkpoint of %s, but the recomputed weights differ from the "
                    "recorded digest (nondeterministic kernels?); training goes on with them", recorded.out)
    return trainer, {"recovered": True, "weights_match": match}


def _commit_update(inp: PPOUpdateInput, commit: Commit) -> ShardRef:
    trainer, steps, seconds, extra = _train(inp)
    strategy = trainer.strategy
    opt_ref = optimizer_state_ref(inp.policy)  # the committed state it continued (its write joined here at the latest)
    inputs = {name: ref for name, ref in (("rollout", inp.rollout), ("advantages", inp.advantages),
                                          ("actor_logprobs", inp.actor_logprobs),
                                          ("ref_logprobs", inp.ref_logprobs if inp.kl.in_loss else None),
                                          ("policy", inp.policy if isinstance(inp.policy, ShardRef) else None),
                                          ("optimizer", opt_ref)) if ref is not None}
    summary = _summary(steps, seconds, extra)
    if inp.policy_version is not None:
        summary["policy_version"] = inp.policy_version  # the version this update starts from
    # a checkpoint iteration in one process whose trainer stays in memory (a resident worker's, or stage mode
    # keeping its models): commit as between checkpoints, the checkpoint in the background
    background = (inp.save_checkpoint and inp.background_checkpoint and isinstance(strategy, SingleProcess)
                  and (current_source() is not None or memo.keeps_models()))
    in_memory = not inp.save_checkpoint or background
    if in_memory:  # the weights stay in memory: what recovery needs to rebuild them exactly
        summary[WEIGHTS_DIGEST_KEY] = trained_digest(strategy)  # a collective under DeepSpeed and FSDP2
        summary[UPDATE_INPUT_KEY] = inp.model_dump(mode="json")
    new = commit_trained(commit, strategy, subdir=POLICY_SUBDIR, tokenizer=trainer.saver, steps=steps, schema=PPO_UPDATE,
                         inputs=inputs, summary=summary, keep_optimizer=False, save_weights=not in_memory)
    if background:  # the optimizer stage first, the weights after it (rft_core.stages.optimizer_state)
        commit_optimizer_state(new, strategy.optimizer.state_dict(), background=True)
        commit_policy_checkpoint(new, strategy.model, trainer.saver, digest=summary[WEIGHTS_DIGEST_KEY])
    elif isinstance(strategy, SingleProcess) and inp.save_checkpoint:
        commit_optimizer_state(new, strategy.optimizer.state_dict(), background=inp.background_optimizer)
    elif isinstance(strategy, (DeepSpeedStrategy, FSDPStrategy)) and inp.save_checkpoint:  # every rank its shards
        commit_sharded_optimizer_state(new, strategy)
    source = current_source()
    if source is not None:  # the next update joins the writes before it starts (_write_lost_checkpoint)
        source.trained(new)
    elif isinstance(strategy, SingleProcess):  # stage mode keeping its models (a no-op in a stage process)
        # the next update trains during the write; its first step waits for a write reading its tensors
        # (not for one reading a host copy: its commit waits for that one, optimizer_state_ref above)
        if inp.save_checkpoint and writes_reading_tensors(new):
            strategy.wait_before_step(lambda: wait_for_writes_of(new))
        memo.keep_trainer(version_key(new), trainer_settings(inp), trainer)
    return new
