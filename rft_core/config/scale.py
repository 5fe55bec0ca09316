"""Scale-out configs: the vLLM and SGLang engines, LoRA, DeepSpeed ZeRO, FSDP2, where each stage
program runs (``runners``, ``orchestration.workers``) and the Ray cluster (``ray``; docs/scale.md)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rft_core.config._base import _Frozen


class VLLMConfig(_Frozen):
    """vLLM engine settings (``rollout.engine=vllm``; GPU, ``make install-gpu``: docs/scale.md)."""

    tensor_parallel_size: int = Field(1, gt=0)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    max_model_len: int | None = Field(None, gt=0)
    enable_sleep_mode: bool = Field(False, description="free GPU memory after the rollout (colocated with training)")
    max_lora_rank: int = Field(64, gt=0)


class SGLangConfig(_Frozen):
    """SGLang engine settings (``rollout.engine=sglang``; GPU, ``make install-gpu GPU_EXTRA=gpu-sglang``:
    docs/scale.md; ``rft_core.engines.sglang.SGLangEngine``)."""

    tensor_parallel_size: int = Field(1, gt=0, description="SGLang tp_size")
    mem_fraction_static: float = Field(0.5, gt=0, le=1, description="fraction of GPU memory for weights and KV cache")
    max_model_len: int | None = Field(None, gt=0, description="SGLang context_length (None: the model's)")
    enable_memory_saver: bool = Field(False, description="release GPU memory after the rollout (colocated with training)")
    max_lora_rank: int = Field(64, gt=0)
    deterministic: bool = Field(True, description="enable_deterministic_inference and a sampling_seed per sample "
                                "(reproducible samples; slower sampling). False: no seeds, samples not reproducible")


class LoraConfig(_Frozen):
    """LoRA adapters through peft (Hu et al. 2021, arXiv:2106.09685): W + (alpha / rank) * B A."""

    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names, or all-linear: every Linear of attention and MLP (not the LM head)")


class DeepSpeedConfig(_Frozen):
    """DeepSpeed ZeRO data parallelism for the update; launch it with torchrun
    (``runners.ppo_update: {mode: subprocess, launcher: torchrun, nproc_per_node: N}``)."""

    zero_stage: Literal[1, 2, 3] = 2
    offload_optimizer: bool = Field(False, description="ZeRO-Offload of the optimizer state to CPU memory")
    torch_adam: bool = Field(True, description="torch's AdamW instead of DeepSpeed's FusedAdam (whose CUDA op "
                             "DeepSpeed compiles with nvcc and ninja on first use)")


class FSDPConfig(_Frozen):
    """torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) data parallelism for the update,
    beside DeepSpeed ZeRO (the two refuse each other): one ``fully_shard`` per decoder layer plus
    the root, parameters, gradients and AdamW state sharded over the ranks (ZeRO-3's layout);
    bfloat16 compute over float32 master shards with ``policy.dtype: bfloat16``
    (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``). Launch it with
    torchrun (``runners.ppo_update: {mode: subprocess, launcher: torchrun, nproc_per_node: N}``)
    or as a resident gang (``orchestration.policy_ranks: N``); docs/scale.md "FSDP2 or DeepSpeed"."""

    reshard_after_forward: bool = Field(True, description="free each layer's gathered parameters after its forward "
                                        "and gather them again in backward (ZeRO-3's memory; false: keep them, "
                                        "ZeRO-2's memory, one all-gather fewer per layer)")
    cpu_offload: bool = Field(False, description="keep the parameter, gradient and AdamW shards in CPU memory "
                              "(FSDP2's CPUOffloadPolicy; AdamW steps on the CPU)")


# Stages whose program can run in a subprocess (another interpreter, torchrun): those holding a model.
RUNNABLE_STAGES = ("rollout", "actor_logprobs", "ref_logprobs", "critic_values", "critic_update", "ppo_update",
                   "teacher_logprobs")


# Stages whose program a resident worker runs (orchestration.workers=resident): the policy's
# trainer (ppo_update), its rollout engine (rollout and the actor pass, which share the engine's
# copy of the policy), the reference model, the critic (values and its update) and on-policy
# distillation's teacher.
RESIDENT_STAGES = ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update", "critic_values", "critic_update",
                   "teacher_logprobs")


# The resident workers' roles (``rft_core.workers.pool.ROLES``), and the task of each shard of
# the rollout fan-out: the keys of ``ray.options``.
RAY_ROLES = ("policy", "rollout", "reference", "critic", "teacher")
ROLLOUT_SHARD = "rollout_shard"


class RayConfig(_Frozen):
    """The Ray cluster a run uses and what it asks of it: one section for both users of Ray, the
    rollout fan-out (``runners.rollout.shards`` > 1: prefect-ray's ``RayTaskRunner``) and the
    resident workers (``orchestration.workers: resident``: ``rft_core.workers.pool``). Never part
    of a config hash."""

    address: str | None = Field(None, description="the cluster to join: ray://host:10001 or auto; None: a local Ray "
                                "started by the run")
    init_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra ray.init arguments (num_cpus, "
                                        "runtime_env, ...)")
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Ray options (num_gpus, resources, runtime_env, ...) per role: policy, "
        "rollout, reference, critic, teacher (each resident worker, over its defaults: num_cpus 0 and, when the Ray cluster has "
        "GPUs, one GPU per actor; rollout: the engine's tensor_parallel_size; a one-GPU cluster: 0.2 each, shared) "
        "and rollout_shard (each task of the rollout fan-out), e.g. {reference: {num_gpus: 0.5}, rollout_shard: "
        "{num_gpus: 1}}")

    @field_validator("options")
    @classmethod
    def _check_roles(cls, v: dict) -> dict:
        bad = sorted(set(v) - {*RAY_ROLES, ROLLOUT_SHARD})
        if bad:
            raise ValueError(f"unknown role(s) {bad}; valid names: {', '.join((*RAY_ROLES, ROLLOUT_SHARD))}")
        return v


class WorkersConfig(_Frozen):
    """How a stage reaches its resident worker (``RunnerConfig.mode == "resident"``): a runtime
    object, not a config section. ``TrainConfig.runner`` builds it from the ``ray`` section (held
    as it is) and ``orchestration`` (a user's ``runners.<stage>.workers`` is a deprecated key,
    ``rft_core.config.deprecated``). Never part of a config hash."""

    pool: str = Field(description="the pool's name (the run root): its workers are the Ray actors named after it")
    ray: RayConfig = Field(default_factory=RayConfig, description="the ray section: the cluster the pool joins "
                           "(address, init_kwargs) and each role's actor options (options[role], over "
                           "rft_core.workers.pool.actor_options' defaults; rollout_shard is the fan-out's, "
                           "no worker's)")
    sync_timeout_s: float = Field(300.0, gt=0, description="orchestration.sync_timeout_s")
    sync_bucket_mb: int = Field(256, gt=0, description="orchestration.sync_bucket_mb")
    threads: int | None = Field(None, gt=0, description="orchestration.worker_threads (None: the caller's count)")
    policy_ranks: int = Field(1, gt=0, description="orchestration.policy_ranks")
    critic_ranks: int = Field(1, gt=0, description="orchestration.critic_ranks")
    rollout_versions: int = Field(1, gt=0, description="policy versions the rollout worker keeps a copy of "
                                  "(rollout.max_staleness s > 1: s)")
    rollout_gpus: int = Field(1, gt=0, description="GPUs of the rollout worker on a cluster with GPUs: the "
                              "engine's tensor_parallel_size (rollout.vllm/sglang), else 1; the same whichever stage "
                              "starts the worker (the rollout, or the actor pass of a resumed run)")
    keep_device_cache: bool = Field(True, description="each worker keeps its CUDA cache between stages (False: a vLLM or "
                                    "SGLang engine shares the GPUs and must find their memory free: rollout.engine != hf)")
    lora: LoraConfig | None = Field(None, description="update.lora: the rollout worker's copy of a LoRA policy below "
                                    "float32 keeps the adapters on its base, as the trainer computes, and its syncs "
                                    "move the adapters only (rft_core.models.lora.keeps_adapters); in float32 it "
                                    "receives the merged weights; a vLLM or SGLang engine serves the adapters in any "
                                    "dtype, as an adapter folder")


class RunnerConfig(_Frozen):
    """Where a stage program runs: in the task's process (default) or as
    ``python -m rft_core.stages <stage>`` in a subprocess, with another interpreter (e.g. a vLLM
    environment) and optionally under torchrun (multi-rank update). Never part of a config hash:
    both modes commit the same shard. ``mode: resident`` and ``workers`` are set by
    ``TrainConfig.runner`` under ``orchestration.workers: resident``, the one way to ask for
    resident workers (written in ``runners``, they are deprecated keys)."""

    mode: Literal["inprocess", "subprocess", "resident"] = "inprocess"
    python: str | None = Field(None, description="interpreter of the subprocess (None: the current one)")
    launcher: Literal["plain", "torchrun"] = "plain"
    nproc_per_node: int = Field(1, gt=0, description="torchrun: ranks on this node")
    torchrun_args: list[str] = Field(default_factory=list, description="extra torchrun flags, e.g. --nnodes=2 --rdzv-endpoint=host:29500")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables of the subprocess")
    tail_lines: int = Field(40, gt=0, description="output lines quoted in the error of a failed subprocess")
    shards: int = Field(1, gt=0, description="rollout only: split over this many Prefect tasks on the Ray cluster "
                        "of the ray section (prefect-ray; each task's resources: ray.options.rollout_shard)")
    workers: WorkersConfig | None = Field(None, description="mode=resident: the pool of resident workers (set by "
                                          "TrainConfig.runner)")
    keep_models: bool = Field(False, description="mode=inprocess: keep the models this process read or trained in "
                              "memory for the next stage that asks for the same committed version "
                              "(rft_core.stages.memo; set by TrainConfig.runner from orchestration.keep_models)")

    @model_validator(mode="after")
    def _check(self) -> "RunnerConfig":
        if self.mode != "subprocess" and (self.launcher != "plain" or self.python):
            raise ValueError("runner.launcher / runner.python need runner.mode=subprocess")
        if (self.mode == "resident") != (self.workers is not None):
            raise ValueError("runner.mode=resident and runner.workers go together (set orchestration.workers=resident)")
        return self


class OrchestrationConfig(_Frozen):
    """How stage tasks meet Prefect's own machinery, and where the model stages run: ``workers``
    is the one key that puts them in resident workers (``runners.<stage>`` then has nothing to
    say about them; under ``workers: stage`` it says how each stage's own process starts). Never
    part of a config hash."""

    concurrency_tags: bool | None = Field(
        None, description="tag stage tasks `gpu`/`cpu` so tag concurrency limits apply; each tagged task costs a "
        "concurrency-slot round trip to the server. None (auto): on when the server has a `gpu` or `cpu` tag limit")
    workers: Literal["auto", "stage", "resident"] = Field(
        "auto", description="stage: every stage loads its model from the run root (one process, or a subprocess per "
        "stage); resident: one long-lived Ray actor per model role (policy trainer, rollout engine, reference) keeps "
        "its model, optimizer and engine across iterations and weights move in memory (docs/scale.md); the Ray "
        "cluster and each role's Ray options: the ray section. auto: resident when a CUDA device is visible, Ray is "
        "installed and resident covers the config, else stage (chosen when the config loads; the run's log says "
        "which and why)")
    keep_models: bool | None = Field(
        None, description="workers=stage, stages run in the task's process: keep the policy trainer (model, masters, "
        "AdamW state) and the inference models in memory between stages, so the next stage that asks for the same "
        "committed version takes it from memory instead of the run root (the same results, bit for bit; every shard "
        "and checkpoint is still written; a new process reads storage as before). None (auto): on with "
        "rollout.engine=hf (a vLLM or SGLang engine needs the GPU memory free)")
    worker_threads: int | None = Field(None, gt=0, description="workers=resident: torch threads per worker (None: as "
                                       "many as the driver's; the same count keeps CPU results bit-identical)")
    sync_timeout_s: float = Field(300.0, gt=0, description="workers=resident: a weight sync that takes longer fails")
    sync_bucket_mb: int = Field(256, gt=0, description="workers=resident: weights move in buckets of this many MiB")
    policy_ranks: int = Field(1, gt=0, description="workers=resident: data-parallel ranks of the policy trainer "
                              "(update.deepspeed, ZeRO 1/2/3, or update.fsdp), one Ray actor each with its own GPU on a cluster "
                              "with GPUs (under workers=stage: runners.ppo_update with torchrun)")
    critic_ranks: int = Field(1, gt=0, description="workers=resident: data-parallel ranks of a DeepSpeed or FSDP2 "
                              "critic (critic.deepspeed or critic.fsdp), one Ray actor each, that keep its shards "
                              "and AdamW state across iterations (under workers=stage: runners.critic_update with "
                              "torchrun; refused above 1 with runners.critic_values or runners.critic_update, "
                              "which run those stages beside the resident workers)")
